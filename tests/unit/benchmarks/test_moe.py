"""The MoE benchmark's dense twin (``benchmarks/moe.py``): the same model with a dense FFN of the MoE layer's active
size, where the model has one; none (said why) where MoE is in some blocks only."""

from __future__ import annotations

from benchmarks.moe import _dense_twin, _no_twin
from pretrain.config import load_config
from pretrain.model import build_model
from tests.conftest import ROOT


def _active_ffn(cfg) -> int:
    """Parameters of the FFN a token runs through in block 0 (top_k experts, or the dense FFN)."""
    model = build_model(cfg.model, 0, cfg.moe)
    ffn = model.blocks[0].ffn
    params = sum(p.numel() for n, p in ffn.named_parameters() if "experts" in n or not cfg.moe.enabled)
    return params // cfg.moe.num_experts * cfg.moe.top_k if cfg.moe.enabled else params


def test_the_twin_is_the_active_size_whatever_sets_the_expert_width():
    for widths in (["moe.ffn_size=128"], ["moe.ffn_size=0", "model.ffn_size=0"], ["moe.ffn_size=0"]):
        cfg = load_config(ROOT / "configs" / "demo-moe.yaml", [*widths, "model.vocab_size=256"])
        assert _no_twin(cfg) == ""
        assert _active_ffn(_dense_twin(cfg)) == _active_ffn(cfg), widths


def test_moe_in_some_blocks_only_has_no_twin_and_says_why():
    cfg = load_config(ROOT / "configs" / "demo-moe-encoder.yaml")
    assert cfg.moe.every != 1 and _no_twin(cfg).startswith("MoE in some blocks only")
