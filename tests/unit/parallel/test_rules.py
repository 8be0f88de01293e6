"""The rules of the parallel layout (``pretrain/parallel/rules.py``): each refusal one line naming what to set; the
plan's rank mapping and the memory plan of a sequence/tensor-parallel layout."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.driver.memory_plan import count_parameters, layout_of, memory
from tests.harness import TINY_MODEL

BASE = (*TINY_MODEL, "data.num_streams=2", "train.global_batch_size=8", "train.micro_batch_size=4")
MOE = ("moe.num_experts=4", "zero.stage=1")


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("parallel.tensor=0",), "parallel.tensor: must be >= 1, got 0"),
        (("parallel.expert=0",), "parallel.expert: must be >= 1, got 0"),
        ((*MOE, "parallel.expert=3", "cluster.num_workers=3"), "parallel.expert: 3 must divide moe.num_experts 4"),
        ((*MOE, "parallel.expert=2"), "parallel.expert: 2 must divide the worker count 1 (cluster.num_workers)"),
        ((*MOE, "parallel.expert=2", "cluster.num_workers=2", "zero.stage=0"), "zero.stage: expert parallelism"),
        ((*MOE, "parallel.expert=2", "cluster.num_workers=2", "zero.stage=3"), "zero.stage: ZeRO-3 cannot partition"),
        (
            ("cluster.num_workers=4", "parallel.sequence=2", "parallel.tensor=2", "model.num_heads=2"),
            "parallel.sequence x parallel.tensor: 4 must divide model.num_heads",
        ),
        (("cluster.num_workers=2", "parallel.tensor=2", *MOE), "parallel.tensor: not with MoE"),
        (
            ("cluster.num_workers=2", "parallel.sequence=2", "train.compile=yes"),
            "train.compile: yes is not supported with parallel.sequence/tensor > 1",
        ),
    ],
)
def test_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *overrides])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_growth_of_moments_is_refused_with_expert_parallelism():
    from types import SimpleNamespace

    from pretrain.parallel import rules

    cfg = SimpleNamespace(growth=SimpleNamespace(optimizer="grow"), parallel=SimpleNamespace(expert=2))
    with pytest.raises(ConfigError, match="growth.optimizer: grow .* not with parallel.expert > 1"):
        rules.check_growth(cfg)
    rules.check_growth(SimpleNamespace(growth=SimpleNamespace(optimizer="grow"), parallel=SimpleNamespace(expert=1)))


def test_rules_import_no_torch():
    """Config validation imports the rules: they stay pure (no torch at import)."""
    import subprocess
    import sys

    code = "import sys, pretrain.parallel.rules, pretrain.parallel.dims; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (("cluster.num_workers=3", "parallel.sequence=2"), "cluster.num_workers: 3 workers do not divide"),
        (
            ("cluster.num_workers=2", "parallel.sequence=2", "model.num_kv_heads=1"),
            "must divide model.num_heads",
        ),
        (
            ("cluster.num_workers=8", "parallel.sequence=8"),
            "parallel.sequence: 8 must divide model.num",
        ),
        (("cluster.num_workers=2", "parallel.sequence=2", "model.max_seq_len=15"), "divide model.max_seq_len"),
        (("cluster.num_workers=2", "parallel.tensor=2", "model.ffn_size=33"), "divide the FFN size (33"),
        (("cluster.num_workers=2", "parallel.tensor=2", "zero.stage=3"), "not with zero.stage 3"),
        (("cluster.num_workers=2", "parallel.tensor=2", "moe.num_experts=2"), "not with MoE"),
        (("cluster.num_workers=2", "parallel.tensor=2", "train.compile=yes"), "train.compile: yes"),
        (
            ("cluster.num_workers=2", "parallel.tensor=2", "model.attention_dropout=0.1"),
            "use model.attention_dropout=0",
        ),
        (("parallel.sequence=0",), "parallel.sequence: must be >= 1"),
    ],
)
def test_layouts_that_cannot_work_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *overrides])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_plan_maps_ranks_to_data_parallel_ranks():
    from pretrain.config import make_plan
    from pretrain.train.step import dropout_seeds, step_seed

    cfg = load_config(None, [*BASE, "cluster.num_workers=8", "parallel.sequence=2", "parallel.tensor=2"])
    plan = make_plan(cfg, 8)
    assert (plan.world_size, plan.workers, plan.model_parallel) == (2, 8, 4)
    assert [plan.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [plan.shares_data(r) for r in range(8)] == [True, False, False, False, True, False, False, False]
    assert plan.owned_streams(3) == plan.owned_streams(0) == [0] and plan.owned_streams(5) == [1]
    assert plan.micro_batch_ids(2) == plan.micro_batch_ids(0) and plan.share(7) == 4
    assert "8 worker(s) (2 data x 2 sequence x 2 tensor parallel)" in plan.describe()
    # dropout seeds: shared by a tensor-parallel pair, one per sequence slice, none shared across data ranks
    seeds = [tuple(dropout_seeds(0, 3, plan.micro_batch_ids(r), plan.dims, r)) for r in range(8)]
    assert seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]
    assert len({seeds[r] for r in (0, 2, 4, 6)}) == 4
    plain = make_plan(load_config(None, [*BASE, "cluster.num_workers=2"]), 2)  # the micro-batch's seed alone
    assert dropout_seeds(0, 3, [5], plain.dims, 1) == [step_seed(0, 3, 5)]


def test_memory_plan_divides_tokens_by_sequence_and_projections_by_tensor_parallelism():
    from pretrain.config import make_plan

    def mem(*layout):
        cfg = load_config(
            None,
            [*BASE, "cluster.num_workers=4", "data.num_streams=4", "zero.stage=1", "train.micro_batch_size=2", *layout],
        )
        return memory(cfg, count_parameters(cfg), layout_of(cfg, make_plan(cfg, 4)))

    dp, sp, tp = mem(), mem("parallel.sequence=2"), mem("parallel.tensor=2")
    assert sp.activations.kept == pytest.approx(dp.activations.kept / 2, rel=0.01)
    assert sp.weights == dp.weights and sp.optimizer == dp.optimizer  # ZeRO over all 4 either way
    assert tp.weights < dp.weights and tp.activations.kept < dp.activations.kept
