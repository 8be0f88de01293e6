"""The architecture after a growth from configs alone and the blocks' share of the FLOPs
(``pretrain/model/growth_stages.py``)."""

from __future__ import annotations

import pytest

from pretrain.config import GrowthStep, load_config
from pretrain.model import flops_per_token
from pretrain.model.growth_stages import block_flops_share, grown_architecture
from tests.conftest import ROOT
from tests.harness import tiny_model

DEMO = ROOT / "configs" / "demo-decoder.yaml"
SMALL = [*tiny_model(vocab_size=512, hidden_size=64, max_seq_len=None), "model.num_kv_heads=2"]


def test_grown_architecture_from_configs_alone():
    cfg = load_config(DEMO, SMALL)
    deep, _ = grown_architecture(cfg.model, cfg.moe, GrowthStep(depth="2x"))
    assert (deep.num_layers, deep.hidden_size) == (4, 64)
    wide, _ = grown_architecture(cfg.model, cfg.moe, GrowthStep(width="2x", width_op="tile"))
    assert (wide.hidden_size, wide.num_heads, wide.num_kv_heads, wide.tie_embeddings) == (128, 8, 4, False)
    assert flops_per_token(wide, 128) > 2 * flops_per_token(cfg.model, 128), "width 2x: about 4x the block FLOPs"


def test_block_flops_share_is_what_the_blocks_compute():
    cfg = load_config(DEMO, SMALL)
    m, total = cfg.model, flops_per_token(cfg.model, 128)
    outside = 6.0 * (m.vocab_size * m.hidden_size + m.hidden_size)  # the LM head matmul and the final norm
    assert block_flops_share(m, 128) == pytest.approx(1 - outside / total, rel=1e-12)
    big = load_config(
        DEMO, [*tiny_model(vocab_size=512, num_layers=8, hidden_size=256, num_heads=None, max_seq_len=None)]
    ).model
    assert block_flops_share(big, 128) > block_flops_share(m, 128)
