"""Ending a run before ``train.max_steps``, as callbacks (the driver's signal handling: :mod:`pretrain.driver.signals`;
the request file between the two: :mod:`pretrain.train.stop_request`):

* :class:`EarlyStop` (order 45): ``train.stop_at_val_loss``, the run ends at the first validation at or below the
  target;
* :class:`StopOnRequest` (order 46): a stop asked for by the driver (a signal, ``./launch.sh stop JOB``), the run
  ends after the current step.

Either way the run ends as a finished one does: validation, a checkpoint at that step, the summary.
"""

from __future__ import annotations

from typing import Any

from pretrain.train import dist
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.step import StepResult
from pretrain.train.stop_request import read_request
from pretrain.train.trainer import Trainer, is_last_step


class EarlyStop(Callback):
    """``train.stop_at_val_loss``: end the run at the first validation at or below the target."""

    order = 45  # after validation has run in a step's on_step_end

    def __init__(self, target: float) -> None:
        self.target = target

    def on_validation(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self.target and metrics["val/loss"] <= self.target and trainer.state.step < trainer.cfg.train.max_steps:
            trainer.progress.say(
                f"val/loss {metrics['val/loss']:.4f} <= train.stop_at_val_loss {self.target}: stopping"
            )
            trainer.stop("train.stop_at_val_loss")


class StopOnRequest(Callback):
    """At each step boundary rank 0 looks for the driver's stop request (:mod:`pretrain.train.stop_request`) and
    every rank learns the answer from one collective, so that all end after the same step. The run then ends as an
    early stop does: validation, a checkpoint at that step (:class:`CheckpointCallback`), the summary — with
    ``stopped`` (the signal, the step) in it."""

    order = 46  # after validation and the early stop have looked at this step, before its checkpoint

    def __init__(self) -> None:
        self.signal = ""

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.signal or is_last_step(trainer):  # a stop during the last step: the run has finished
            return
        request = read_request(trainer.run_dir) if trainer.ctx.is_main else None
        asked = 1.0 if request is not None else 0.0
        if trainer.ctx.world_size > 1:
            asked = dist.all_reduce_sum([asked], trainer.ctx.device)[0]
        if not asked:
            return
        self.signal = str((request or {}).get("signal", "stop"))
        trainer.progress.say(f"{self.signal}: stopping after step {trainer.state.step}")
        trainer.stop(self.signal)

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        if self.signal:
            final["stopped"] = {"signal": self.signal, "step": trainer.state.step}
