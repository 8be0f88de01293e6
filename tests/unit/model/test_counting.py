"""Tests of pretrain.model.counting: AdamW's parameter groups, parameter counts and training FLOPs per token."""

from __future__ import annotations

import pytest
import torch

from pretrain.model import build_model, flops_per_token, num_parameters, param_groups
from tests.unit.model.test_transformer import D, L, T, V, tiny


@pytest.mark.parametrize("tied,bias,position", [(True, False, "rotary"), (False, True, "learned")])
def test_param_groups(tied, bias, position):
    cfg = tiny(
        tie_embeddings=tied,
        bias=bias,
        position=position,
        norm="layernorm",
        kind="encoder",
        mlm_head_transform=True,
        embedding_norm=True,
    )
    model = build_model(cfg, 0)
    groups = param_groups(model, weight_decay=0.1)
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == len(list(model.parameters()))
    decay = {id(p) for g in groups if g["weight_decay"] == 0.1 for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    for pid, name in names.items():
        should_decay = name.endswith("weight") and ("proj" in name or "dense" in name or name == "lm_head.weight")
        assert (pid in decay) == should_decay, name
    assert id(model.embed_tokens.weight) not in decay  # also when it is the tied LM head
    if position == "learned":
        assert id(model.embed_positions.weight) not in decay
    torch.optim.AdamW(groups, lr=1e-3)  # groups are valid optimizer input


def test_num_parameters_and_flops():
    untied = build_model(tiny(tie_embeddings=False, position="learned"), 0)
    tied = build_model(tiny(tie_embeddings=True, position="learned"), 0)
    assert num_parameters(untied) - num_parameters(tied) == V * D  # tied counted once
    assert num_parameters(tied) == sum(p.numel() for p in tied.state_dict().values()) - V * D
    emb = V * D + T * D
    assert num_parameters(tied, exclude_embeddings=True) == num_parameters(tied) - emb
    assert num_parameters(untied, exclude_embeddings=True) == num_parameters(untied) - emb

    for cfg in (tiny(tie_embeddings=True), tiny(tie_embeddings=False), tiny(activation="swiglu", num_kv_heads=1)):
        model = build_model(cfg, 0)
        n = num_parameters(model, exclude_embeddings=True)
        f = flops_per_token(cfg, T)
        assert f > 6 * n
        head = V * D if cfg.tie_embeddings else 0  # the tied head matmul still costs FLOPs
        assert f == 6 * (n + head) + 12 * L * D * T
