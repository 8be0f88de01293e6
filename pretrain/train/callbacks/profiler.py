"""``train.profile_at``: the torch profiler over a window of training steps, as a callback.

Every rank profiles steps ``[profile_at, profile_at + profile_steps)`` (the same steps everywhere, so
collectives line up in the traces) and writes, under ``RUN_DIR/profile/``, a Chrome trace
(``rank{R}_steps{A}-{B}.json``, open it in https://ui.perfetto.dev or chrome://tracing) and the operator table
sorted by self time (``rank{R}_steps{A}-{B}.txt``), preceded by the loop's own table: the wall time of the window
split into the batch fetch, the step and each callback's events (the ``loop/*`` ranges of
:mod:`pretrain.train.ranges`) and what falls outside them. Rank 0 also logs its files as MLflow artifacts
(``profile/``). The profiled steps run slower; their tokens/s are not representative.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pretrain.train.callbacks.base import Callback
from pretrain.train.ranges import PREFIX
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer

TABLE_ROWS = 40


class ProfilerCallback(Callback):
    order = 1  # right after SpeedMonitor: the profile covers the whole step, the other callbacks included

    def __init__(self, first: int, count: int):
        self.first, self.last = first, first + max(count, 1) - 1
        self._prof: Any = None
        self._t0 = 0.0

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        if step == self.first and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if trainer.module.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=False)
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self._prof is not None and trainer.state.step >= self.last:
            self._finish(trainer, trainer.state.step)

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        if self._prof is not None:  # the run ended inside the window
            self._finish(trainer, trainer.state.step)

    def _finish(self, trainer: Trainer, last: int) -> None:
        prof, self._prof = self._prof, None
        if trainer.module.device.type == "cuda":
            torch.cuda.synchronize(trainer.module.device)
        wall = time.perf_counter() - self._t0
        prof.__exit__(None, None, None)
        out = Path(trainer.run_dir) / "profile"
        out.mkdir(parents=True, exist_ok=True)
        stem = f"rank{trainer.ctx.rank}_steps{self.first}-{last}"
        trace, table = out / f"{stem}.json", out / f"{stem}.txt"
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if trainer.module.device.type == "cuda" else "self_cpu_time_total"
        averages = prof.key_averages()
        table.write_text(
            loop_table(averages, wall, last - self.first + 1)
            + "\n\n"
            + averages.table(sort_by=sort, row_limit=TABLE_ROWS)
            + "\n"
        )
        if trainer.ctx.is_main:
            trainer.tracker.log_file(trace, "profile")
            trainer.tracker.log_file(table, "profile")
            trainer.progress.say(f"profiled steps {self.first}-{last}: {trace} (operator table: {table.name})")


# Emitted inside another callback's event.
_NESTED = (".on_validation", ".on_checkpoint", ".on_nonfinite_weights", ".on_rollback", ".on_halt")


def loop_table(averages, wall: float, steps: int) -> str:
    """The window's wall time per ``loop/*`` range (inclusive), largest first, and the time outside them."""
    rows = sorted(
        ((e.key[len(PREFIX) :], e.count, e.cpu_time_total / 1e6) for e in averages if e.key.startswith(PREFIX)),
        key=lambda r: -r[2],
    )
    outside = wall - sum(s for name, _, s in rows if not name.endswith(_NESTED))
    lines = [
        f"loop: {steps} step(s) in {wall:.3f} s wall (profiler on); per range, inclusive",
        f"{'range':<44} {'calls':>6} {'total s':>9} {'ms/step':>9} {'share':>7}",
    ]
    for name, calls, seconds in [*rows, ("(outside the ranges)", 0, outside)]:
        lines.append(
            f"{name:<44} {calls:>6} {seconds:>9.4f} {seconds / steps * 1e3:>9.2f} {seconds / max(wall, 1e-9):>7.1%}"
        )
    return "\n".join(lines)
