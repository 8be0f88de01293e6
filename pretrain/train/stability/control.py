"""The loop's side of stability control: a thin impure shell around :class:`StabilityMonitor` (the functional
core in :mod:`pretrain.train.stability.monitor`): events to progress lines and MLflow, halts and rollbacks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pretrain.checkpoint import store as ckpt_store
from pretrain.checkpoint.reader import read_trainer_state
from pretrain.checkpoint.store import CommittedCheckpoint
from pretrain.config import RunConfig
from pretrain.train import dist, tracking
from pretrain.train.progress import Progress
from pretrain.train.stability.monitor import REPORT_FILE, TAG_LAST_EVENT, StabilityMonitor, event_line
from pretrain.train.tracking import Tracker


class StabilityControl:
    """The trainer's side (a thin impure shell, driven by ``StabilityCallback``): events to progress and MLflow,
    halts and rollbacks. The decisions come from :class:`StabilityMonitor`, identical on all ranks; its state is
    ``StabilityCallback``'s (saved and restored under the callback's name). ``state`` is the trainer's
    ``TrainerState`` (step, tokens seen, FLOPs, sequences)."""

    def __init__(
        self, cfg: RunConfig, state: Any, ctx: dist.DistContext, run_dir: Path, tracker: Tracker, progress: Progress
    ):
        self.cfg, self.state, self.ctx, self.run_dir = cfg, state, ctx, run_dir
        self.tracker, self.progress = tracker, progress
        self.monitor = StabilityMonitor(cfg.stability, cfg.moe)
        self.history: list[tuple[int, float, float]] = []  # (step, loss, grad norm): the plot without MLflow
        self._dirty = False

    def report(self, event: dict[str, Any], urgent: bool) -> None:
        """An event: a progress line, the ``stability/*`` counters, a tag; the timeline artifact."""
        self.progress.say(event_line(event))
        self.tracker.log_metrics(self.monitor.counters(), event["step"])
        tags = {
            TAG_LAST_EVENT: f"step {event['step']}: {event['kind']} -> {event['action']}",
            "pretrain.stability.events": self.monitor.s.events_total,
        }
        self._recorded(lambda: self.tracker.set_tags(tags))
        self._dirty = True
        if urgent:
            self.flush()

    def flush(self, force: bool = False) -> None:
        """Upload ``stability/timeline.json`` if it changed (events of the ``log`` policy wait for this); a
        tracking store that refuses it leaves it changed, for the next flush."""
        if (self._dirty or force) and self._recorded(
            lambda: self.tracker.log_json(self.monitor.summary(), "stability/timeline.json")
        ):
            self._dirty = False

    def _recorded(self, write: Callable[[], None]) -> bool:
        """``write`` to MLflow; a store that refuses it (a server down) is a warning, not the end of the run: the
        event is in the progress output, the checkpoints' state and the next timeline upload."""
        from mlflow.exceptions import MlflowException

        try:
            write()
        except MlflowException as e:
            self.progress.say(f"warning: MLflow did not take a stability record ({str(e).splitlines()[0][:200]})")
            return False
        return True

    def halt(self, event: dict[str, Any]) -> Exception:
        err = self.monitor.halt(event)
        if self.ctx.is_main:
            path = self.run_dir / REPORT_FILE
            ckpt_store.write_json(path, err.report)
            self.tracker.log_json(err.report, "stability/report.json")
            self.flush(force=True)
            self.progress.say(f"HALT: {err}; report: {path}")
        return err

    def rollback(self, load: Callable[[CommittedCheckpoint], None], step: int) -> Path:
        """Restore the newest good checkpoint (``load`` puts its engine state in place) and its counters (step,
        tokens seen, FLOPs); the data stream stays where it is (``sequences`` too), so the window since that
        checkpoint is skipped; later checkpoints of the abandoned trajectory move to ``abandoned/``."""
        target = self.monitor.rollback_target()
        assert target is not None, "decide() only rolls back to an existing good checkpoint"
        path = Path(target["path"])
        ckpt = ckpt_store.open_committed(path)
        load(ckpt)
        abandoned = ckpt_store.abandon_after(self.run_dir, target["step"]) if self.ctx.is_main else None
        abandoned = dist.broadcast_object(abandoned)
        event = self.monitor.rolled_back(step, target, target["sequences"], self.state.sequences, abandoned)
        self._restore_counters(target["step"], read_trainer_state(ckpt))
        self.report(event, urgent=True)
        self.tracker.set_tags({tracking.TAG_CKPT_LATEST: str(path), tracking.TAG_CKPT_STEP: target["step"]})
        return path

    def _restore_counters(self, step: int, saved: dict[str, Any]) -> None:
        """Back to ``step`` with the tokens seen, FLOPs, last validation and last training loss of that checkpoint's
        trainer state (``saved``). A checkpoint
        written before FLOPs were counted gets the current run's FLOPs per step so far times its step."""
        state = self.state
        flops = float(saved.get("flops") or 0.0)
        if step and not flops and state.step:
            flops = state.flops / state.step * step
        state.step, state.tokens_seen, state.flops = step, int(saved["tokens_seen"]), flops
        state.last_val = dict(saved.get("last_val") or {})  # what that checkpoint's run had validated
        state.last_train_loss = float(saved.get("last_train_loss", float("nan")))

    def plot(self, tracking_uri: str) -> str:
        """Rank 0: the PNG of loss, grad norm and events (from MLflow when tracked), saved and logged."""
        from pretrain.train.plot import plot_run, plot_training  # a leaf module (matplotlib), imported only here

        path = self.run_dir / "training.png"
        try:
            if self.tracker.enabled:  # the whole run from MLflow, resumed parts included; logged there too
                self.tracker.flush()  # the metrics queued so far
                out = plot_run(tracking_uri, self.tracker.run_id, path)
            else:
                series = {
                    "train/loss": [(s, x) for s, x, _ in self.history],
                    "train/grad_norm": [(s, g) for s, _, g in self.history],
                }
                out = plot_training(
                    series, self.monitor.summary()["timeline"], path, title=f"run {self.tracker.run_id}"
                )
        except Exception as e:  # noqa: BLE001 - a picture must never fail a finished run
            self.progress.say(f"plot failed: {type(e).__name__}: {e}")
            return ""
        self.progress.say(f"training plot: {out}")
        return str(out)

    def record(self, step: int, loss: float, grad_norm: float) -> None:
        """Rank 0 without MLflow: keep (a thinned) history for the end-of-run plot."""
        if self.ctx.is_main and not self.tracker.enabled:
            self.history.append((step, loss, grad_norm))
            if len(self.history) > 100_000:
                self.history = self.history[::2]
