"""The capability sections of the config (``pretrain/config/capabilities.py``): bad MoE values named by path, the
presets, growth points."""

from __future__ import annotations

import re

import pytest

from pretrain.config import ConfigError, load_config
from tests.conftest import ROOT
from tests.unit.model.test_moe import _small


@pytest.mark.parametrize(
    "over,message",
    [
        (["moe.top_k=5"], "moe.top_k"),
        (["parallel.expert=3", "cluster.num_workers=3"], "parallel.expert: 3 must divide moe.num_experts"),
        (["parallel.expert=2"], "parallel.expert: 2 must divide the worker count 1"),
        (["parallel.expert=2", "cluster.num_workers=2", "zero.stage=3"], "zero.stage: ZeRO-3 cannot partition"),
        (["parallel.expert=2", "cluster.num_workers=2", "zero.stage=0"], "zero.stage: expert parallelism"),
        (["moe.layers=[7]"], "moe.layers[0]: block 7 does not exist"),
        (["moe.every=3"], "moe.every: 3 selects no block"),
        (["moe.capacity_factor=-1"], "moe.capacity_factor"),
        (["moe.top_k=x"], "moe.top_k: expected int"),
        (["moe.balance=loss"], "moe.balance: expected one of aux_loss, bias, both"),
        (["moe.balance=bias", "moe.bias_rate=0"], "moe.bias_rate: must be > 0 with moe.balance=bias"),
        (["moe.bias_rate=-1"], "moe.bias_rate: must be >= 0"),
    ],
)
def test_bad_moe_config_is_named(over, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _small(*over)


def test_zero3_with_ep1_and_presets_validate():
    _small("zero.stage=3", "cluster.num_workers=2")  # experts are ordinary weights: ZeRO-3 shards them
    for name in ("demo-moe", "mixtral-8x-1b", "demo-moe-encoder"):
        cfg = load_config(ROOT / "configs" / f"{name}.yaml")
        assert cfg.moe.enabled
    demo = load_config(ROOT / "configs" / "demo-moe.yaml")
    assert (demo.model.kind, demo.moe.num_experts, demo.moe.top_k) == ("decoder", 4, 2)


@pytest.mark.parametrize(
    "schedule, message",
    [
        ("[{at_step: 10, at_tokens: 5}]", "growth.schedule[0]: at_step 10 and at_tokens 5 both give the growth point"),
        ("[{at_fraction: 0.5, at_step: 10}]", "growth.schedule[0]: at_step 10 and at_fraction 0.5 both give the"),
        (
            "[{at_fraction: 0.5}, {at_fraction: 0.2, width: 2x}]",
            "growth.schedule[1]: at_fraction 0.2 is not after growth.schedule[0]'s 0.5; the growths must come in order",
        ),
        ("[{at_tokens: 9000}, {at_tokens: 9000, width: 2x}]", "growth.schedule[1]: at_tokens 9000 is not after"),
        (
            "[{at_step: 10}, {at_tokens: 5000}, {at_step: 5, width: 2x}]",
            "growth.schedule[2]: at_step 5 is not after growth.schedule[0]'s 10",
        ),
    ],
)
def test_growth_points_given_twice_or_out_of_order_are_refused(schedule, message):
    """``GrowthConfig.check_given_points`` (a config as written) and ``check_order`` (points of one kind); points of
    different kinds are compared once resolved (``tests/unit/driver/test_budget.py``)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(ROOT / "configs" / "demo-decoder.yaml", ["train.max_flops=4e12", f"growth.schedule={schedule}"])
