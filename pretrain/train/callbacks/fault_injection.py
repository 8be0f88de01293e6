"""Test-only fault injection (``faults.*``): kill a worker, a NaN gradient, an LR spike, a stop, slow steps."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from pretrain.config import RunConfig
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer, is_last_step

SPIKE_LR_FACTOR = 1000.0  # faults.loss_spike_at_step


class FaultInjection(Callback):
    """Test-only ``faults.*`` hooks; each fires once per run (the fired ones are saved in every checkpoint, so
    neither a rollback nor a resume replays them)."""

    order = 20
    name = "faults_fired"  # also the top-level key that TrainerState.from_dict moves under ``callbacks``

    def __init__(self, cfg: RunConfig) -> None:
        self.faults = cfg.faults
        self.spike = self.poison = False
        self.fired: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"fired": list(self.fired)}

    def load_state_dict(self, state: dict[str, Any] | list[str]) -> None:
        self.fired = list(state["fired"] if isinstance(state, dict) else state)  # a list: the fired names alone

    def _fire(self, trainer: Trainer, name: str, at_step: int, step: int) -> bool:
        if at_step != step or name in self.fired:
            return False
        self.fired.append(name)
        trainer.progress.say(f"[fault] {name} injected at step {step}")
        return True

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        if self.faults.slow_step_s:
            time.sleep(self.faults.slow_step_s)
        ctx = trainer.ctx
        victim = ctx.rank == min(1, ctx.world_size - 1)
        if self.faults.kill_worker_at_step == step and victim:
            _kill_once(trainer.run_dir, ctx.rank, step)
        self.spike = self._fire(trainer, "loss_spike", self.faults.loss_spike_at_step, step)
        # Recorded on every rank, but poisons one rank's gradients only.
        self.poison = self._fire(trainer, "nan_grad", self.faults.nan_grad_at_step, step) and victim

    def lr_factor(self, step: int) -> float:
        return SPIKE_LR_FACTOR if self.spike else 1.0

    def objective(self, objective: torch.Tensor, index: int, count: int) -> torch.Tensor:
        return _NaNGrad.apply(objective) if self.poison and index == count - 1 else objective

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if self._fire(trainer, "nan_weights", self.faults.nan_weights_at_step, trainer.state.step):
            with torch.no_grad():
                next(trainer.module.engine.module.parameters()).view(-1)[0] = float("nan")
        if trainer.state.step == self.faults.stop_after_step and not is_last_step(trainer):
            trainer.progress.say(f"stopping after step {trainer.state.step} (faults.stop_after_step)")
            trainer.stop("faults.stop_after_step")


def _kill_once(run_dir: Path, rank: int, step: int) -> None:
    """SIGKILL this worker, once per run across restarts (a marker in the run directory)."""
    marker = run_dir / ".faults" / f"killed_at_step_{step}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {rank} pid {os.getpid()}\n")
    print(f"[fault] rank {rank} kills itself with SIGKILL at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class _NaNGrad(torch.autograd.Function):
    """Identity forward, NaN backward: fault injection that poisons this rank's gradients only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))
