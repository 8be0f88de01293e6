"""The progress line and the ``train/*`` metrics in MLflow every ``train.log_every`` steps."""

from __future__ import annotations

import math
from typing import Any

from pretrain.model.moe import routing_metrics
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer, is_last_step


class MetricsLogger(Callback):
    """Every ``train.log_every`` steps (and the last): the progress line and ``train/*`` metrics (plus every
    callback's ``extra_metrics``) to MLflow, and the MoE routing metrics."""

    order = 30
    name = "metrics_window"  # the losses since the last logged step: a resume logs the train/loss_avg the run would

    def __init__(self) -> None:
        self.window: list[float] = []
        self.moe_metrics: dict[str, float] = {}

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if math.isfinite(result.loss):
            self.window.append(result.loss)
        step = trainer.state.step
        if step % trainer.cfg.train.log_every and not is_last_step(trainer):
            return
        metrics = {
            "train/loss": result.loss,
            "train/lr": trainer.module.engine.optimizer.param_groups[0]["lr"],
            "train/grad_norm": result.grad_norm,
            "train/tokens_per_s": trainer.progress.window_tokens_per_s(),
            "train/tokens_seen": float(trainer.state.tokens_seen),
            "train/flops": trainer.state.flops,
            "train/loss_avg": sum(self.window) / len(self.window) if self.window else float("nan"),
        }
        for extra in trainer.gather("extra_metrics"):
            metrics.update(extra)
        self.window.clear()
        trainer.progress.line(step, metrics)
        trainer.tracker.log_metrics(metrics, step)
        if result.moe:
            self.moe_metrics = routing_metrics(result.moe)
            trainer.tracker.log_metrics(self.moe_metrics, step)

    def on_rollback(self, trainer: Trainer) -> None:
        self.window.clear()  # losses of the abandoned steps

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window = [float(v) for v in state["window"]]

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        if self.moe_metrics:
            final["moe"] = self.moe_metrics
