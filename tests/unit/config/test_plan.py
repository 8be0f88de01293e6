"""The run plan (``pretrain/config/plan.py``): the global batch on any worker count, the micro-batch a cap, bad
layouts named with what to set; ZeRO data parallelism, the plan's side: dropout seeds follow the global
micro-batch, whatever the worker count."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError, load_config, make_plan
from tests.conftest import ROOT

DEMO = ROOT / "configs" / "demo-decoder.yaml"


@pytest.mark.parametrize("streams, global_batch, micro", [(2, 8, 4), (4, 8, 2), (8, 16, 2), (8, 16, 1)])
def test_micro_batch_ids_do_not_depend_on_worker_count(streams, global_batch, micro):
    """Dropout seeds are per global micro-batch: the same micro-batch gets the same id on any worker count."""
    from pretrain.config import load_config, make_plan

    cfg = load_config(
        None,
        [f"data.num_streams={streams}", f"train.global_batch_size={global_batch}", f"train.micro_batch_size={micro}"],
    )

    def owner_map(world):  # micro-batch id -> the stream its sequences come from
        plan = make_plan(cfg, world)
        assert plan.micro_batch == micro
        out = {}
        per_stream = global_batch // streams // micro
        for rank in range(world):
            owned = [s for s in range(streams) if s % world == rank]
            for j, mid in enumerate(plan.micro_batch_ids(rank)):
                out[mid] = (owned[j // per_stream], j % per_stream)
        return out

    single = owner_map(1)
    assert sorted(single) == list(range(global_batch // micro))
    for world in (2, streams):
        if streams % world == 0 and global_batch // world % micro == 0:
            assert owner_map(world) == single


@pytest.mark.parametrize(
    "workers, micro, accum, shares",
    [(1, 16, 1, (16,)), (2, 8, 1, (8, 8)), (3, 2, 3, (6, 6, 4)), (4, 4, 1, (4, 4, 4, 4)), (8, 2, 1, (2,) * 8)],
)
def test_plan_keeps_the_global_batch_on_any_worker_count(workers, micro, accum, shares):
    cfg = load_config(DEMO, [f"cluster.num_workers={workers}"])  # the default demo, unchanged otherwise
    plan = make_plan(cfg, workers)
    assert (plan.micro_batch, plan.grad_accum, plan.shares) == (micro, accum, shares)
    assert sum(plan.shares) == plan.global_batch == cfg.train.global_batch_size == 16
    assert plan.tokens_per_step == 16 * cfg.model.max_seq_len
    assert sum(plan.val_shares) == cfg.train.val_sequences
    # DeepSpeed's averaging (1/accum per micro-batch, mean over workers) times the scale = mean over real ones.
    assert plan.gradient_scale() * plan.real_micro_batches == workers * plan.grad_accum
    ids = sorted(i for r in range(workers) for i in plan.micro_batch_ids(r))
    assert ids == list(range(plan.real_micro_batches)), "every real micro-batch has one global id"


def test_plan_micro_batch_is_a_cap_and_bad_layouts_name_what_to_set():
    plan = make_plan(load_config(DEMO, ["train.micro_batch_size=4"]), 1)
    assert (plan.micro_batch, plan.grad_accum) == (4, 4)
    plan = make_plan(load_config(DEMO, ["train.micro_batch_size=5"]), 1)
    assert (plan.micro_batch, plan.grad_accum) == (4, 4), "the largest micro-batch within the cap that splits 16"
    with pytest.raises(
        ConfigError,
        match=r"^cluster.num_workers: 16 workers but only data.num_streams=8 .*"
        r"set data.num_streams to a multiple of 16",
    ):
        load_config(DEMO, ["cluster.num_workers=16"])
    assert "plan: 3 worker(s), global batch 16" in make_plan(load_config(DEMO), 3).describe()
    with pytest.raises(ConfigError, match="^train.val_sequences: 2 is fewer than the 4 workers"):
        load_config(DEMO, ["cluster.num_workers=4", "train.val_sequences=2"])
    # tensor or sequence parallelism: the data is shared by the data-parallel ranks, and the advice counts workers
    with pytest.raises(
        ConfigError,
        match=r"^cluster.num_workers: 2 data-parallel ranks \(4 workers\) but only data.num_streams=1 .* "
        r"or use at most 2 workers$",
    ):
        load_config(DEMO, ["cluster.num_workers=4", "parallel.tensor=2", "data.num_streams=1"])
    with pytest.raises(ConfigError, match=r"^train.val_sequences: 1 is fewer than the 2 data-parallel ranks \(4 w"):
        load_config(DEMO, ["cluster.num_workers=4", "parallel.sequence=2", "train.val_sequences=1"])
