"""Learning-rate schedule: a pure function of the step (so resume needs no scheduler state)."""

from __future__ import annotations

import dataclasses
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


def _last_lr(step: int, cfg: TrainConfig) -> float:
    """The LR of the run's ``step``-th step (1-based; past ``max_steps``: of its last step)."""
    return lr_at(min(step, cfg.max_steps) - 1, cfg)


def raises_lr(saved: TrainConfig, cfg: TrainConfig, step: int) -> bool:
    """Whether resuming a run scheduled by ``saved`` after ``step`` steps with the schedule of ``cfg`` raises the LR
    above both the last step's and what ``saved`` planned next (a rise of the saved schedule itself, the warm-up,
    is no jump)."""
    if step <= 0:
        return False
    before = _last_lr(step, saved)
    planned = lr_at(step, saved) if step < saved.max_steps else before
    return lr_at(step, cfg) > max(planned, before) * (1 + 1e-6)  # a printed LR's rounding is no rise


def extension_refusal(saved: TrainConfig, cfg: TrainConfig, step: int) -> str:
    """Why resuming a run scheduled by ``saved`` after ``step`` steps with the schedule of ``cfg`` would raise the
    LR (:func:`raises_lr`), in one line; '' when it would not. The schedule is a function of ``max_steps``: a larger
    ``max_steps`` moves a cosine or linear decay (and WSD's decay phase) later, so a run whose LR has started to
    decay would jump back up the curve."""
    if not raises_lr(saved, cfg, step):
        return ""
    keys = ("max_flops", "max_steps", "lr", "decay", "warmup_steps", "min_lr_ratio", "decay_steps", "decay_fraction")
    changed = ", ".join(
        f"train.{k} {getattr(saved, k)} -> {getattr(cfg, k)}" for k in keys if getattr(saved, k) != getattr(cfg, k)
    )
    return (
        f"{changed or 'the schedule'} would raise the LR from {_last_lr(step, saved):.3g} (step {step}) to "
        f"{lr_at(step, cfg):.3g} at step {step + 1}: a '{saved.decay}' schedule is a function of train.max_steps. "
        f"To train on without a jump, hold the LR reached: {' '.join(continue_overrides(saved, step, cfg.max_steps))}"
        " — or plan a run of open length with train.decay=wsd and end it with ./launch.sh anneal (docs/schedules.md)"
    )


def continue_overrides(saved: TrainConfig, step: int, max_steps: int) -> list[str]:
    """Overrides that resume a run scheduled by ``saved`` after ``step`` steps up to ``max_steps`` without raising
    the LR: ``max_steps`` alone where the schedule would not move (constant; WSD still at its peak), else with the
    LR reached held constant."""
    longer = [*(["train.max_flops=0"] if saved.max_flops else []), f"train.max_steps={max_steps}"]  # else derived
    if not raises_lr(saved, dataclasses.replace(saved, max_steps=max_steps), step):
        return longer
    return [*longer, "train.decay=constant", f"train.lr={_last_lr(step, saved):.8g}"]


def schedule_warning(cfg: TrainConfig) -> str:
    """A line when the schedule never decays because the warm-up lasts the whole run ('' otherwise)."""
    if cfg.decay == "constant" or cfg.warmup_steps < cfg.max_steps:
        return ""
    return (
        f"warning: train.warmup_steps ({cfg.warmup_steps}) >= train.max_steps ({cfg.max_steps}): the LR rises for the "
        f"whole run and ends at {lr_at(cfg.max_steps - 1, cfg):.3g}, never decaying ({cfg.decay}); lower "
        "train.warmup_steps"
    )
