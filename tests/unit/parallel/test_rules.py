"""The rules of the parallel layout (``pretrain/parallel/rules.py``): each refusal one line naming what to set. The
sequence/tensor cases at config load are in tests/unit/test_model_parallel_config.py."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError, load_config
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
