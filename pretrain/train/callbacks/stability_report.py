"""The stability summary, timeline and plot at the end of a run."""

from __future__ import annotations

from typing import Any

from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.stability_control import StabilityControl
from pretrain.train.trainer import Callback, Trainer


class StabilityReport(Callback):
    """At the end: the stability summary in the result, the timeline flushed, the plot drawn (rank 0)."""

    order = 190

    def __init__(self, control: StabilityControl, tracking_uri: str) -> None:
        self.control, self.tracking_uri = control, tracking_uri

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        final["stability"] = self.control.monitor.summary()
        if trainer.ctx.is_main:
            self.control.flush(force=True)
            if trainer.cfg.stability.plot_at_end:
                final["plot"] = self.control.plot(self.tracking_uri)
