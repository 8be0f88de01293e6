"""Learning-rate schedule: a pure function of the step (so resume needs no scheduler state)."""

from __future__ import annotations

import math

from pretrain.config import TrainConfig


def decay_shape(shape: str, progress: float) -> float:
    """Fraction of the way from the peak down to the floor at ``progress`` in [0, 1] of a decay phase:
    ``linear`` p, ``cosine`` (1 - cos(pi p)) / 2, ``1-sqrt`` sqrt(p) (the LR is peak - (peak - floor) * this)."""
    if shape == "linear":
        return progress
    if shape == "cosine":
        return 0.5 * (1.0 - math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return math.sqrt(progress)
    raise ValueError(f"unknown decay shape {shape!r}")


def wsd_decay_steps(cfg: TrainConfig) -> int:
    """Length of the decay phase of ``decay: wsd`` (``decay_steps``, else ``decay_fraction`` of the run)."""
    return cfg.decay_steps or max(1, round(cfg.decay_fraction * cfg.max_steps))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warm-up, then decay to ``min_lr_ratio * lr``.

    ``wsd`` (warmup-stable-decay) holds the peak until the last ``wsd_decay_steps`` steps, which go down to the
    floor in ``decay_shape``: the decay's step j (1-based) has progress j / D, so its last step is at the floor."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return peak
    if cfg.decay == "wsd":
        span = wsd_decay_steps(cfg)
        start = cfg.max_steps - span
        if step < start:
            return peak
        return peak - (peak - floor) * decay_shape(cfg.decay_shape, min(1.0, (step - start + 1) / span))
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.decay == "linear":
        return peak + (floor - peak) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
