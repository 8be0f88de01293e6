"""The MoE section of the config (``pretrain/config/capabilities.py``): bad values named by path, the presets."""

from __future__ import annotations

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
