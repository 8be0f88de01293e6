"""``train.stop_at_val_loss``: end the run at the first validation at or below the target."""

from __future__ import annotations

from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.trainer import Callback, Trainer


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
