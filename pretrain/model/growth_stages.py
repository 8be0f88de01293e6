"""Training FLOPs of a run whose model grows: the architecture after each growth (from the configs alone, on the
meta device) and the FLOPs per token of each stage (:func:`pretrain.model.flops_per_token`)."""

from __future__ import annotations

import dataclasses

import torch

from pretrain.config import GrowthStep, ModelConfig, MoEConfig
from pretrain.model.counting import active_parameters, flops_per_token
from pretrain.model.growth import apply_growth
from pretrain.model.transformer import SkipInitOnMeta, Transformer


def grown_architecture(model: ModelConfig, moe: MoEConfig, entry: GrowthStep) -> tuple[ModelConfig, MoEConfig]:
    """The model and MoE configs that ``entry`` grows ``model`` into: the growth operators applied to a weightless
    (meta) model, so any size costs nothing."""
    with torch.device("meta"), SkipInitOnMeta():
        state = Transformer(model, moe).state_dict()
    grown = apply_growth(model, moe, state, dataclasses.replace(entry, noise=0.0), seed=0)
    return grown.model, grown.moe


def stage_architectures(
    model: ModelConfig, moe: MoEConfig, schedule: list[GrowthStep]
) -> list[tuple[ModelConfig, MoEConfig]]:
    """The architecture trained before the first growth of ``schedule`` and after each one (len(schedule) + 1)."""
    stages = [(model, moe)]
    for entry in schedule:
        stages.append(grown_architecture(*stages[-1], entry))
    return stages


def block_flops_share(model: ModelConfig, seq_len: int, moe: MoEConfig | None = None) -> float:
    """The share of :func:`flops_per_token` in the Transformer blocks (their weights and attention): what depth
    and width growth shrink. The rest is the LM head (and an encoder's head transform)."""
    with torch.device("meta"), SkipInitOnMeta():
        net = Transformer(model, moe)
    total = flops_per_token(model, seq_len, moe)
    outside = sum(p.numel() for name, p in net.named_parameters() if not name.startswith("blocks."))
    block_params = active_parameters(net) - outside  # MoE: the top-k experts, as flops_per_token counts them
    return (6.0 * block_params + 12.0 * model.num_layers * model.hidden_size * seq_len) / total
