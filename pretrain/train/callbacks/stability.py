"""Stability control as callbacks (the parts: :mod:`pretrain.train.stability`):

* :class:`StabilityCallback` (order 10): the guard of every update — its decision and the actions (skip, roll back,
  halt, cool-down);
* :class:`StabilityReport` (order 190): the stability summary, timeline and plot at the end of a run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.model.moe import max_shares
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.resume import rollback_loader
from pretrain.train.stability.control import StabilityControl
from pretrain.train.stability.monitor import Decision
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer, is_last_step


class StabilityCallback(Callback):
    """The stability guard of every update and the actions of its decisions (see ``stability.py``). Publishes the
    step of the latest event (``trainer.shared.last_event_step``) and keeps its rollback targets from pruning."""

    order = 10
    name = "stability"

    def __init__(self, control: StabilityControl) -> None:
        self.control = control
        self.monitor = control.monitor

    def on_run_start(self, trainer: Trainer) -> None:
        # resumed: that checkpoint is a rollback candidate, unless the run wrote it because it stopped there (the
        # uninterrupted run has no checkpoint at that step, and rolls back to the one before)
        at_stop = (trainer.state.callbacks.get("checkpoint") or {}).get("at_stop", False)
        if trainer.last_checkpoint is not None and not at_stop:
            self.monitor.note_checkpoint(trainer.state.step, str(trainer.last_checkpoint), trainer.state.sequences)
        trainer.shared.last_event_step = self.monitor.s.last_event_step

    def lr_factor(self, step: int) -> float:
        return self.monitor.lr_factor(step)

    def decide(self, signals):
        return self.monitor.decide(signals)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        step = trainer.state.step
        self.control.record(step, result.loss, result.grad_norm)
        for event in self.monitor.router_collapse(step, max_shares(result.moe)) if result.moe else ():
            self.control.report(event, urgent=False)
        trainer.shared.last_event_step = self.monitor.s.last_event_step
        logged_step = step % trainer.cfg.train.log_every == 0 or is_last_step(trainer)
        decision = result.decision
        # the plot shows the spike; once: MetricsLogger logs a step it sees, and a rollback or halt ends it before
        if decision is not None and decision.event is not None:
            if decision.action in ("rollback", "halt") or not logged_step:
                trainer.tracker.log_metrics({"train/loss": result.loss, "train/grad_norm": result.grad_norm}, step)
        if self.act(trainer, decision):
            trainer.end_step()
            return
        if logged_step:
            self.control.flush()

    def on_model_changed(self, trainer: Trainer) -> None:
        self.monitor.restart(trainer.cfg.moe)  # no rollback across a growth; statistics of the new model only

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        self.monitor.note_checkpoint(trainer.state.step, str(path), trainer.state.sequences)

    def on_nonfinite_weights(self, trainer: Trainer, step: int) -> None:
        self.act(trainer, self.monitor.nonfinite_weights(step))

    def act(self, trainer: Trainer, decision: Decision | None) -> bool:
        """Carry out a decision's side effects; True when it rolled back (the step's remaining events are void)."""
        if decision is None:
            return False
        if decision.event is not None:
            self.control.report(decision.event, decision.action != "log")
        if decision.action == "halt":
            assert decision.event is not None  # halt and rollback decisions record an event
            trainer.emit("on_halt")  # a save in flight is committed first (every rank halts at this step)
            raise self.control.halt(decision.event)
        if decision.action == "rollback":
            assert decision.event is not None  # halt and rollback decisions record an event
            trainer.emit("on_rollback")  # a save in flight is committed first (its target may be that one)
            trainer.last_checkpoint = self.control.rollback(
                rollback_loader(trainer.module, trainer.run_dir, trainer.ctx), decision.event["step"]
            )
            return True
        return False

    def extra_metrics(self) -> dict[str, float]:
        return self.monitor.counters()

    def protected_paths(self) -> set[str]:
        return self.monitor.protected_paths()

    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state)


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
