"""``train.profile_at``: the torch profiler over a window of training steps, as a callback.

Every rank profiles steps ``[profile_at, profile_at + profile_steps)`` (the same steps everywhere, so
collectives line up in the traces) and writes, under ``RUN_DIR/profile/``, a Chrome trace
(``rank{R}_steps{A}-{B}.json``, open it in https://ui.perfetto.dev or chrome://tracing) and the operator table
sorted by self time (``rank{R}_steps{A}-{B}.txt``). Rank 0 also logs its files as MLflow artifacts
(``profile/``). The profiled steps run slower; their tokens/s are not representative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pretrain.train.step import StepResult
from pretrain.train.trainer import Callback, Trainer

TABLE_ROWS = 40


class ProfilerCallback(Callback):
    order = 1  # right after SpeedMonitor: the profile covers the whole step, the other callbacks included

    def __init__(self, first: int, count: int):
        self.first, self.last = first, first + max(count, 1) - 1
        self._prof: Any = None

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        if step == self.first and self._prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if trainer.module.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities, record_shapes=False)
            self._prof.__enter__()

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
        prof.__exit__(None, None, None)
        out = Path(trainer.run_dir) / "profile"
        out.mkdir(parents=True, exist_ok=True)
        stem = f"rank{trainer.ctx.rank}_steps{self.first}-{last}"
        trace, table = out / f"{stem}.json", out / f"{stem}.txt"
        prof.export_chrome_trace(str(trace))
        sort = "self_cuda_time_total" if trainer.module.device.type == "cuda" else "self_cpu_time_total"
        table.write_text(prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS) + "\n")
        if trainer.ctx.is_main:
            trainer.tracker.log_file(trace, "profile")
            trainer.tracker.log_file(table, "profile")
            trainer.progress.say(f"profiled steps {self.first}-{last}: {trace} (operator table: {table.name})")
