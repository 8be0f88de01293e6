"""Validation every ``train.val_every`` steps, each ``train.val_every_flops`` training FLOPs, at the last step, and
when a run stops early."""

from __future__ import annotations

from typing import Any

import torch

from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.step import StepResult, evaluate
from pretrain.train.trainer import Trainer, is_last_step, stopped_early


class ValidationCallback(Callback):
    """Validation every ``train.val_every`` steps, each time the run's training FLOPs pass a multiple of
    ``train.val_every_flops``, at the last step, and when a run stops early. Every validation also logs
    ``val/flops``, the run's training FLOPs at that point (to compare runs of different sizes), and ``val/train_s``,
    the seconds this process has spent in training steps (validation and checkpoints left out; time to a loss)."""

    order = 40

    def __init__(self, byte_lengths: torch.Tensor | None = None) -> None:
        self.validated_at = -1
        self.byte_lengths = byte_lengths  # decoders: val/bits_per_byte

    def run(self, trainer: Trainer) -> None:
        state = trainer.state
        if not trainer.val_set or self.validated_at == state.step:
            return
        self.validated_at = state.step
        state.last_val = evaluate(trainer.module, trainer.val_set, self.byte_lengths)
        at = {"val/flops": state.flops, "val/train_s": trainer.progress.train_seconds}
        trainer.tracker.log_metrics({**state.last_val, **at}, state.step)
        trainer.progress.say(
            f"step {state.step} validation: " + ", ".join(f"{k} {v:.4f}" for k, v in state.last_val.items())
        )
        trainer.emit("on_validation", state.last_val)

    name = "validation"  # a resume at a step that validated does not validate (and log) it again

    def on_rollback(self, trainer: Trainer) -> None:
        self.validated_at = -1  # the run goes back: the steps ahead are new ones and validate again

    def state_dict(self) -> dict[str, Any]:
        return {"validated_at": self.validated_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.validated_at = int(state.get("validated_at", -1))

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        t, state = trainer.cfg.train, trainer.state
        every, per_flops = t.val_every, t.val_every_flops
        passed = per_flops and state.flops // per_flops > (state.flops - trainer.flops_per_step()) // per_flops
        if is_last_step(trainer) or (every and state.step % every == 0) or passed:
            self.run(trainer)

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        if stopped_early(trainer):
            self.run(trainer)
        final.update({k.replace("/", "_"): v for k, v in trainer.state.last_val.items()})
