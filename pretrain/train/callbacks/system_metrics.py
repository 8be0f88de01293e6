"""``tracking.system_metrics``: MLflow's ``SystemMetricsMonitor`` (CPU, memory, disk, network, GPU under
``system/``) on rank 0 for the run's duration."""

from __future__ import annotations

from typing import Any

from pretrain.train.callbacks.base import Callback
from pretrain.train.trainer import Trainer


class SystemMetrics(Callback):
    """``tracking.system_metrics``: MLflow's own sampler (``system/*`` metrics) on rank 0 while the run trains."""

    order = 2  # a background sampler: starts before and stops after the steps, independent of their order

    def __init__(self) -> None:
        self.monitor: Any = None

    def on_run_start(self, trainer: Trainer) -> None:
        if not (trainer.ctx.is_main and trainer.tracker.enabled):
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.monitor = SystemMetricsMonitor(
            trainer.tracker.run_id, tracking_uri=trainer.tracker.uri, resume_logging=trainer.state.step > 0
        )
        self.monitor.start()

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None
