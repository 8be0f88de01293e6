"""Activation recomputation of a block: ``full`` (keep only the block's input) or ``selective`` (keep the outputs
of the expensive ops, recompute the rest), through torch's non-reentrant ``checkpoint``.

``selective`` is op-level selective activation checkpointing (``create_selective_checkpoint_contexts``, as in
torchtitan): the outputs of matmuls and attention are saved in the forward and not recomputed; everything else
(norms, activations, rotary, residual adds, dropout masks, casts) is recomputed in the backward from them, so
the backward redoes cheap memory-bound work only. Dropout draws the same numbers again (checkpoint restores the
RNG state), so all three modes compute the same losses and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
SAVED_OPS: tuple[Any, ...] = tuple(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_grouped_mm",
    )
    if hasattr(_aten, name)
)
"""Ops whose outputs ``selective`` keeps: the FLOP-heavy ones (linear layers lower to mm/addmm, attention to one
fused SDPA kernel, grouped experts to _grouped_mm)."""


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def run_block(mode: str, block: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """``block(*args)`` with the activations of ``mode`` (one of :data:`MODES`) kept for the backward."""
    if mode == "none":
        return block(*args)
    if mode == "full":
        return checkpoint(block, *args, use_reentrant=False)
    if mode == "selective":
        return checkpoint(block, *args, use_reentrant=False, context_fn=_contexts)
    raise ValueError(f"unknown activation checkpointing mode {mode!r} (one of {', '.join(MODES)})")
