"""What a model costs and how it is optimized: parameter counts (unique, active, without embeddings), training
FLOPs per token, and AdamW's parameter groups."""

from __future__ import annotations

import torch
import torch.nn as nn

from pretrain.config import ModelConfig, MoEConfig
from pretrain.model.moe import moe_layers
from pretrain.model.transformer import SkipInitOnMeta, Transformer


def _embedding_weights(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: Linear weights (2-D+) decay; biases, norms and embeddings (incl. tied) do not."""
    embeddings = _embedding_weights(model)
    decay_ids: set[int] = set()
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.dim() >= 2 and id(m.weight) not in embeddings:
            decay_ids.add(id(m.weight))
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():  # deduplicated: a tied weight appears once
        (decay if id(p) in decay_ids else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def num_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Unique parameter count (tied weights once); optionally without token/position embeddings."""
    skip = _embedding_weights(model) if exclude_embeddings else set()
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def active_parameters(model: Transformer, exclude_embeddings: bool = False) -> int:
    """Parameters a token passes through: MoE layers count their router and top_k experts only."""
    n = num_parameters(model, exclude_embeddings)
    for _, layer in moe_layers(model):
        per_expert = sum(p.numel() for p in layer.experts[0].parameters())
        n -= per_expert * (layer.num_local_experts - layer.top_k)
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int, moe: MoEConfig | None = None) -> float:
    """Training FLOPs per token, 6N + 12*L*D*T (PaLM appendix B).

    N counts the active non-embedding parameters (top-k experts per MoE layer) plus the LM-head matmul (V*D)
    even when it is tied to the embedding, because the matmul is computed either way.
    """
    with torch.device("meta"), SkipInitOnMeta():
        model = Transformer(cfg, moe)
    n = active_parameters(model, exclude_embeddings=True)
    if cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.hidden_size
    return 6.0 * n + 12.0 * cfg.num_layers * cfg.hidden_size * seq_len
