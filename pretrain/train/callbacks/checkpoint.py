"""Committed checkpoints every ``checkpoint.every_steps``, at the end, and when a run stops early."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.checkpoint import layout
from pretrain.checkpoint.store import CheckpointError
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.checkpointer import Checkpointer, NonFiniteWeightsError
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer, is_last_step, stopped_early


class CheckpointCallback(Callback):
    """Checkpoints every ``checkpoint.every_steps``, at the last step, and when a run stops early. An asynchronous
    save (``checkpoint.async``) is committed at the first step boundary after every rank has written it, before a
    stability rollback, before the next save, and at the end of the run."""

    order = 50
    name = "checkpoint"
    """Its state records whether a checkpoint was written because the run stopped early (``at_stop``): one the
    uninterrupted run does not have, so a resume from it does not make it a rollback target."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer
        self.at_stop = False
        self.rolled_back = False
        """A rollback since the last save: the state is not the last checkpoint's any more, even at its step (the
        skipped data window, the rollback's record), so a stop saves it again."""

    def state_dict(self) -> dict[str, Any]:
        return {"at_stop": self.at_stop}

    def save(self, trainer: Trainer) -> None:
        # At most one save in flight: the one still in flight (its commit slower than the steps since) is
        # committed first, and said, before this one starts.
        self.committed(trainer, self.checkpointer.finish())
        trainer.collect_state()
        try:
            path = self.checkpointer.save(
                trainer.module, trainer.batches, trainer.state, lambda: set().union(*trainer.gather("protected_paths"))
            )
        except NonFiniteWeightsError:
            trainer.emit("on_nonfinite_weights", trainer.state.step)
            return
        self.rolled_back = False
        if self.checkpointer.in_flight is None:  # synchronous: committed already
            self.committed(trainer, path)
        trainer.emit("on_checkpoint", path)  # its state is fixed: a rollback target once it proves good

    def committed(self, trainer: Trainer, path: Path | None) -> None:
        if path is not None:
            trainer.last_checkpoint = path
            trainer.progress.say(f"checkpoint committed: step {layout.step_of(path.name)}")

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self.checkpointer.warm(trainer.module)
        self.committed(trainer, self.checkpointer.poll())
        every = trainer.cfg.checkpoint.every_steps
        # The first step after a rollback saves: the restored weights with the data position past the skipped window
        # and the rollback's record. Until then a resume (a worker lost, the job killed) would start from the
        # target, with its data position, and train through the window the rollback skipped.
        if is_last_step(trainer) or (every and trainer.state.step % every == 0) or self.rolled_back:
            self.save(trainer)

    def on_rollback(self, trainer: Trainer) -> None:
        self.committed(trainer, self.checkpointer.finish())
        self.rolled_back = True

    def on_halt(self, trainer: Trainer) -> None:
        self.committed(trainer, self.checkpointer.finish())

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        try:
            self.committed(trainer, self.checkpointer.finish())
        except CheckpointError as e:  # the same on every rank (the save's outcome is collective)
            if not stopped_early(trainer):
                raise
            # A stop is a checkpoint: the save in flight failed (a passing I/O error), the stop's own may not.
            trainer.progress.say(f"warning: {e}; saving at the stop instead")
        last = trainer.last_checkpoint
        at_last = last is not None and last.name.endswith(f"{trainer.state.step:08d}") and not self.rolled_back
        if stopped_early(trainer) and not at_last:
            self.at_stop = True
            step = trainer.state.step
            self.save(trainer)
            if trainer.state.step != step:  # its weights were not finite: rolled back, and the restored state (the
                self.save(trainer)  # skipped data window, the rollback's record) is what a resume continues
                state = trainer.state  # the summary is the restored state's, not the abandoned one's
                final.update(step=state.step, tokens_seen=state.tokens_seen, final_train_loss=state.last_train_loss)
                for key in [k for k in final if k.startswith("val_")]:  # the abandoned weights' validation
                    del final[key]
                final.update({k.replace("/", "_"): v for k, v in state.last_val.items()})
                if isinstance(final.get("stopped"), dict):
                    final["stopped"]["step"] = state.step
            self.committed(trainer, self.checkpointer.finish())
        self.checkpointer.writer.settle()  # pruned checkpoints deleted before the run ends
        self.checkpointer.writer.record_pending()  # rank 0: those MLflow did not take at their commit, if it does now
        final.update(
            self.checkpointer.summary(), checkpoint=str(trainer.last_checkpoint) if trainer.last_checkpoint else ""
        )
