"""A stop asked for by the driver (a signal, ``./launch.sh stop JOB``): the run ends after the current step."""

from __future__ import annotations

from typing import Any

from pretrain.train import dist
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.step import StepResult
from pretrain.train.stop_request import read_request
from pretrain.train.trainer import Callback, Trainer


class StopOnRequest(Callback):
    """At each step boundary rank 0 looks for the driver's stop request (:mod:`pretrain.train.stop_request`) and
    every rank learns the answer from one collective, so that all end after the same step. The run then ends as an
    early stop does: validation, a checkpoint at that step (:class:`CheckpointCallback`), the summary — with
    ``stopped`` (the signal, the step) in it."""

    order = 46  # after validation and the early stop have looked at this step, before its checkpoint

    def __init__(self) -> None:
        self.signal = ""

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self.signal:
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
