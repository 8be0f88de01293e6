"""The speed of the loop a user runs, as a standard callback: step time (the progress line's tokens/s), the
loop's wall-clock tokens/s in steady state, and the time from the command's start to the first completed step,
split into its phases (:mod:`pretrain.timeline`).

Summary keys (``summary.json``, the CLI's ``final``):

* ``tokens_per_s``: tokens over the time inside the steps (``on_step_start`` to ``on_step_end``: the batch is
  already fetched; validation, checkpoints and a growth's rebuild excluded), as the progress line shows;
* ``loop_mean_tokens_per_s``: tokens over the wall time between the ends of the steady-state steps (the first
  ``LOOP_WARMUP_STEPS`` excluded): everything between two steps counts — fetching the batch, every callback,
  logging, MLflow, and validation or checkpoints when they fall inside;
* ``loop_tokens_per_s``: the same over the best (least disturbed by other processes) run of ``loop_window``
  consecutive steps, ``loop_window`` being a whole number of logging and health cycles (lcm of
  ``train.log_every`` and ``stability.health_every``) so every window holds their costs in full — the measure
  the step benchmark's best-of-rounds compares with;
* ``torch_threads``: the intra-op threads this worker trained with (``train.num_threads`` or its CPU share);
* ``time_to_first_step_s`` and ``startup_phases_s``: from the command's start (the process start) to the end of
  this process's first step, per phase (they add up to the total).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from pretrain import startup_gc, timeline
from pretrain.train.callbacks.base import Callback
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer

LOOP_WARMUP_STEPS = 5
"""Steps left out of ``loop_tokens_per_s`` (allocator and kernel warm-up, the first MLflow calls)."""


def loop_rates(
    ends: list[float], tokens_per_step: int, window: int, warmup: int = LOOP_WARMUP_STEPS
) -> tuple[float, float, int]:
    """From the ends of consecutive steps: steady-state tokens/s (mean), the best over ``window`` consecutive
    steps, and how many steps the mean covers. The first ``warmup`` steps are left out (fewer when the run is
    short, so at least one interval remains); a run shorter than the window gives the mean as its best."""
    ends = ends[min(warmup, max(len(ends) - 2, 0)) :]
    steps = len(ends) - 1
    if steps < 1:
        return 0.0, 0.0, 0
    mean = steps * tokens_per_step / max(ends[-1] - ends[0], 1e-9)
    window = min(max(window, 1), steps)
    best = max(window * tokens_per_step / max(b - a, 1e-9) for a, b in zip(ends, ends[window:]))
    return mean, best, steps


def cycle(log_every: int, health_every: int) -> int:
    """Steps after which the periodic per-step work (logging, health probes) repeats."""
    return math.lcm(max(log_every, 1), max(health_every, 1))


class SpeedMonitor(Callback):
    """Times each step for the progress line, and the loop and the start-up for the summary (order 0: first, so
    a step's end is stamped before any other callback's work)."""

    order = 0

    def __init__(self) -> None:
        self._t0 = 0.0
        self.ends: list[float] = []
        self.startup: dict[str, float] = {}

    def on_run_start(self, trainer: Trainer) -> None:
        timeline.enter("first_batch")  # the first batch is fetched after the run start events

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        if not self.ends:
            timeline.enter("first_step")
        self._t0 = time.perf_counter()

    def on_model_changed(self, trainer: Trainer) -> None:
        self._t0 = time.perf_counter()  # a growth rebuilt the model in this step's start: not step time

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        now = time.perf_counter()
        trainer.shared.step_s = now - self._t0
        trainer.progress.add_step(trainer.shared.step_s)
        self.ends.append(now)
        if len(self.ends) == 1:
            self._first_step(trainer, time.time())

    def _first_step(self, trainer: Trainer, end: float) -> None:
        marks = timeline.marks()
        timeline.finish()
        startup_gc.resume()  # start-up is over (a no-op unless this process paused the collector)
        if not marks:
            return
        self.startup = timeline.phases(marks, end)
        total = end - marks[0][1]
        trainer.progress.say(
            f"first step {total:.1f} s after the command started: "
            + ", ".join(f"{k} {v:.1f}" for k, v in self.startup.items())
            + " s"
        )
        trainer.tracker.log_metrics(
            {"startup/time_to_first_step_s": total, **{f"startup/{k}_s": v for k, v in self.startup.items()}},
            trainer.state.step,
        )

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        window = cycle(trainer.cfg.train.log_every, trainer.cfg.stability.health_every)
        mean, best, steps = loop_rates(self.ends, trainer.plan.tokens_per_step, window)
        final.update(
            tokens_per_s=trainer.progress.tokens_per_s(),
            train_seconds=trainer.progress.train_seconds,
            loop_tokens_per_s=best,
            loop_mean_tokens_per_s=mean,
            loop_window=window,
            loop_steps_timed=steps,
            torch_threads=torch.get_num_threads(),
        )
        if self.startup:
            final.update(time_to_first_step_s=sum(self.startup.values()), startup_phases_s=dict(self.startup))
