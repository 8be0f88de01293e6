"""Health probes (``stability.health_every``) logged to MLflow."""

from __future__ import annotations

from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.health import HealthProbe
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer


class HealthCallback(Callback):
    """Health metrics (``stability.health_every``): probes the first micro-batch's forward and the update."""

    order = 15

    def __init__(self, every: int) -> None:
        self.every = every
        self.probe: HealthProbe | None = None
        self.health: dict[str, float] = {}

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        module = trainer.module
        probed = self.every and step % self.every == 0
        self.probe = HealthProbe(module.engine, module.plan.dims) if probed else None
        self.health = {}

    def before_forward(self, module, index: int) -> None:
        if self.probe is not None and index == 0:
            self.probe.attach()

    def after_forward(self, module, index: int, output) -> None:
        if self.probe is not None and index == 0:
            self.probe.detach(output)

    def before_update(self, module) -> None:
        if self.probe is not None:
            self.probe.before_update()

    def after_update(self, module) -> None:
        if self.probe is not None:
            self.probe.after_update()
            self.health = self.probe.reduce(module.device)  # collective

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if not self.health:
            return
        since = max(0, trainer.state.step - trainer.shared.last_event_step)
        health = self.health
        skipped = [f"block{i:02d}" for i in sorted(trainer.shared.skipped_blocks)]
        if skipped:  # per-layer metrics count executed layers only
            health = {k: v for k, v in health.items() if not k.endswith(tuple(skipped))}
        trainer.tracker.log_metrics({**health, "health/steps_since_event": float(since)}, trainer.state.step)
