"""Learning-rate schedule: a pure function of the step (so resume needs no scheduler state)."""

from __future__ import annotations

import dataclasses
import math

from pretrain.config import TrainConfig
from pretrain.invocation import command


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
    return cfg.wsd_decay_steps()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warm-up, then decay to ``min_lr_ratio * lr``.

    ``cosine`` and ``linear`` decay from ``warmup_steps`` (the peak) with progress (step - warmup) / (max_steps -
    warmup), so they reach the floor at step ``max_steps``, one after the last step, which runs just above it.
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


DECAY_INPUTS: dict[str, tuple[str, ...]] = {
    "constant": (),
    "linear": ("decay", "max_steps", "min_lr_ratio"),
    "cosine": ("decay", "max_steps", "min_lr_ratio"),
    "wsd": ("decay", "max_steps", "min_lr_ratio", "decay_shape"),
}
"""``train.*`` keys a decay's LRs depend on, besides ``lr`` and ``warmup_steps`` (WSD: also its phase's length)."""

TOLERANCE = 1e-6
"""Relative LR difference that is no rise: a printed LR's rounding (``continue_overrides`` prints 8 digits)."""


def decay_start(cfg: TrainConfig) -> int | None:
    """The first step (0-based) whose LR depends on how the schedule decays; None: never (``constant``).

    Before it, the LR is the warm-up ``lr * (step + 1) / warmup_steps`` and then the peak ``lr``: a function of
    ``lr`` and ``warmup_steps`` alone. A cosine or linear decay spans ``warmup_steps`` (progress 0: the peak) to
    ``max_steps``, so its step ``warmup_steps + 1`` is the first below the peak; WSD's decay phase is the last
    ``wsd_decay_steps`` steps of ``max_steps`` (its first step already below the peak)."""
    if cfg.decay == "constant":
        return None
    if cfg.decay == "wsd":
        return max(cfg.warmup_steps, cfg.max_steps - wsd_decay_steps(cfg))
    return cfg.warmup_steps + 1


def schedule_inputs(cfg: TrainConfig, steps: int) -> dict[str, object]:
    """What the LRs of the first ``steps`` steps are a function of: ``lr`` and ``warmup_steps``, and once those steps
    reach the decay (:func:`decay_start`) also the decay's keys (:data:`DECAY_INPUTS`). Two schedules with the same
    inputs give those steps the same LRs."""
    inputs: dict[str, object] = {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps}
    start = decay_start(cfg)
    if start is not None and steps > start:
        inputs.update({k: getattr(cfg, k) for k in DECAY_INPUTS[cfg.decay]})
        if cfg.decay == "wsd":
            inputs["wsd_decay_steps"] = wsd_decay_steps(cfg)
    return inputs


def keeps_schedule(saved: TrainConfig, cfg: TrainConfig, step: int) -> bool:
    """Whether the schedule of ``cfg`` gives the ``step`` steps a checkpoint trained under ``saved`` the LRs they
    had: a warm-up or a peak extended by ``max_steps`` alone, a constant run; not a decay moved by ``max_steps``."""
    return schedule_inputs(saved, step) == schedule_inputs(cfg, step)


def raises_lr(saved: TrainConfig, cfg: TrainConfig, step: int) -> bool:
    """Whether resuming after ``step`` steps trained under ``saved`` with the schedule of ``cfg`` is a jump of the LR:
    ``cfg`` changes the schedule of the steps trained and gives the next step (0-based ``step``) a higher LR than
    both the last step trained had and ``saved`` gives the next step. A schedule kept (:func:`keeps_schedule`) is
    no jump, whatever comes after: a continuing warm-up rises as the uninterrupted run's does (also past
    ``saved.max_steps``)."""
    if step <= 0 or keeps_schedule(saved, cfg, step):
        return False
    return lr_at(step, cfg) > max(lr_at(step - 1, saved), lr_at(step, saved)) * (1 + TOLERANCE)


def extension_refusal(saved: TrainConfig, cfg: TrainConfig, step: int) -> str:
    """Why resuming after ``step`` steps trained under ``saved`` with the schedule of ``cfg`` would make the LR jump
    (:func:`raises_lr`), in one line with the overrides that train on instead; '' when it would not."""
    if not raises_lr(saved, cfg, step):
        return ""
    keys = (
        *("max_flops", "max_steps", "lr", "decay", "warmup_steps", "min_lr_ratio"),
        *("decay_steps", "decay_fraction", "decay_shape"),
    )
    changed = ", ".join(
        f"train.{k} {getattr(saved, k)} -> {getattr(cfg, k)}" for k in keys if getattr(saved, k) != getattr(cfg, k)
    )
    names = {"wsd_decay_steps": "decay_steps (or train.decay_fraction)"}
    inputs = ", ".join(f"train.{names.get(k, k)}" for k in schedule_inputs(saved, step))
    overrides = continue_overrides(saved, step, cfg.max_steps)
    line = (
        f"{changed or 'the schedule'} would raise the LR from {lr_at(step - 1, saved):.3g} (step {step}) to "
        f"{lr_at(step, cfg):.3g} at step {step + 1}, where the checkpoint's schedule gives {lr_at(step, saved):.3g}: "
        f"the LRs of the {step} steps trained are a function of {inputs}. "
    )
    why = decayed_out(saved, step)
    if why:
        return line + why[0].upper() + why[1:]
    line += f"To train on without a jump: {' '.join(overrides)}"
    if "train.decay=constant" in overrides and saved.decay != "constant":
        line += " (the LR reached, held) — or " + (
            f"anneal a checkpoint of the stable phase with {command()} anneal (docs/schedules.md)"
            if saved.decay == "wsd"
            else f"plan a run of open length with train.decay=wsd and end it with {command()} anneal "
            "(docs/schedules.md)"
        )
    return line


def decayed_out(saved: TrainConfig, step: int) -> str:
    """Why no resume after ``step`` steps trained under ``saved`` trains on, '' when one does: the last step trained
    had an LR of 0 (a decay to a floor of 0), and a schedule that changes the steps trained may not raise it."""
    longer = dataclasses.replace(saved, max_steps=2 * step + 1, max_flops=0.0)
    if keeps_schedule(saved, longer, step) or lr_at(step - 1, saved) > 0:
        return ""
    return (
        f"the LR has decayed to 0 (train.min_lr_ratio={saved.min_lr_ratio:g}), and any LR to train on would be a "
        f"jump: for more training, anneal a checkpoint before the decay ({command()} anneal), or start a new run "
        f"from its weights ({command()} export, then model.init_from_hf)"
    )


def continue_overrides(saved: TrainConfig, step: int, max_steps: int) -> list[str]:
    """Overrides that resume after ``step`` steps trained under ``saved`` up to ``max_steps`` without a jump of the
    LR and without a new warm-up: ``max_steps`` alone where that keeps the schedule of the steps trained (no decay
    yet, or ``constant``), else the LR of the last step trained, held (``decay: constant``; the decay began after
    the warm-up, so the warm-up does not run again) with ``min_lr_ratio`` rescaled so that the floor, which a
    constant schedule does not use, stays the run's (``anneal`` decays to it)."""
    longer = [*(["train.max_flops=0"] if saved.max_flops else []), f"train.max_steps={max_steps}"]  # else derived
    if keeps_schedule(saved, dataclasses.replace(saved, max_steps=max_steps, max_flops=0.0), step):
        return longer
    held = lr_at(step - 1, saved)
    ratio = min(1.0, saved.lr * saved.min_lr_ratio / held) if held > 0 else saved.min_lr_ratio
    return [*longer, "train.decay=constant", f"train.lr={held:.8g}", f"train.min_lr_ratio={ratio:.8g}"]


def train_longer(saved: TrainConfig, step: int) -> str:
    """The overrides of the "train longer" command a run, or a run derived from it, prints after ``step`` steps:
    twice the steps, by :func:`continue_overrides`."""
    return " ".join(continue_overrides(saved, step, 2 * step))


def resume_overrides(saved: TrainConfig, step: int) -> str:
    """What a printed ``resume`` adds after a checkpoint at ``step``: nothing before the run's last step (the run
    trains on as scheduled), the :func:`train_longer` overrides at or past it (a bare resume has nothing to do)."""
    return train_longer(saved, step) if step >= saved.max_steps else ""


def schedule_warning(cfg: TrainConfig) -> str:
    """A line when the schedule never decays because the warm-up lasts the whole run ('' otherwise)."""
    if cfg.decay == "constant" or cfg.warmup_steps < cfg.max_steps:
        return ""
    return (
        f"warning: train.warmup_steps ({cfg.warmup_steps}) >= train.max_steps ({cfg.max_steps}): the LR rises for the "
        f"whole run and ends at {lr_at(cfg.max_steps - 1, cfg):.3g}, never decaying ({cfg.decay}); lower "
        "train.warmup_steps"
    )
