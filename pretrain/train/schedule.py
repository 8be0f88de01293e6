"""Learning-rate schedule: a pure function of the step (so resume needs no scheduler state)."""

from __future__ import annotations

import math

from pretrain.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warm-up, then decay to ``min_lr_ratio * lr``."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return peak
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "linear":
        return peak + (floor - peak) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
