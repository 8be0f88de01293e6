"""The trainer: a generic loop that runs steps and emits ordered events to callbacks.

The callback contract — every event and step hook, when it runs, what it may change, the ``order`` of the
callbacks — is :mod:`pretrain.train.callbacks.base` (the :class:`Callback` base and the :class:`Shared` blackboard);
the standard set of a run is declared in :mod:`pretrain.train.callbacks.standard`.

A new behaviour at step N (a growth schedule, a layer-drop schedule) is a new callback plus a config section;
the loop does not change (see docs/architecture.md). Callbacks never look each other up: what one offers the others
goes through the trainer — the :class:`Shared` blackboard, the events (``on_model_changed``), and the
aggregated answers of :meth:`Trainer.gather` (``extra_metrics``, ``protected_paths``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from pretrain.config import RunConfig, RunPlan
from pretrain.data import TrainBatches
from pretrain.train import dist
from pretrain.train.callbacks.base import Callback, Shared
from pretrain.train.progress import Progress
from pretrain.train.ranges import loop_range
from pretrain.train.step import StepInput, dropout_seeds, run_step, step_seed
from pretrain.train.tracking import Tracker


@dataclass
class TrainerState:
    """Loop counters, saved in every checkpoint (``trainer_state.json``)."""

    step: int = 0
    tokens_seen: int = 0
    flops: float = 0.0
    """Training FLOPs so far (``train/flops``): model FLOPs per token times tokens, each growth stage at its size."""
    last_train_loss: float = float("nan")
    last_val: dict[str, float] = field(default_factory=dict)
    sequences: int = 0
    """Global sequences consumed (the data position; more than step * batch after a rollback)."""
    callbacks: dict[str, Any] = field(default_factory=dict)
    """``state_dict()`` of every stateful callback, by its ``name``."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainerState:
        """The state saved as ``raw`` (``asdict`` of a TrainerState). A top-level key that is not a counter
        (``stability``, ``faults_fired``) is a callback's state: it moves under ``callbacks`` by its own name, where
        the callback of that name finds it."""
        known = {f.name for f in fields(cls)}
        callbacks = dict(raw.get("callbacks") or {})
        for key, value in raw.items():
            if key not in known and value is not None:
                callbacks.setdefault(key, value)
        return cls(**{k: v for k, v in raw.items() if k in known and k != "callbacks"}, callbacks=callbacks)


class Trainer:
    """Runs the steps of one worker. Everything a callback may need is an attribute."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        plan: RunPlan,
        ctx: dist.DistContext,
        module,
        batches: TrainBatches,
        val_set: list[dict[str, torch.Tensor]],
        state: TrainerState,
        tracker: Tracker,
        progress: Progress,
        run_dir: Path,
        callbacks: Sequence[Callback],
        last_checkpoint: Path | None = None,
    ):
        self.cfg, self.plan, self.ctx, self.module = cfg, plan, ctx, module
        self.batches, self.val_set, self.state = batches, val_set, state
        self.tracker, self.progress, self.run_dir = tracker, progress, run_dir
        self.callbacks = sorted(callbacks, key=lambda c: c.order)  # stable: equal orders keep their order
        self.last_checkpoint = last_checkpoint
        self.shared = Shared()
        self.stop_reason = ""
        self._step_ended = False
        self._flops: tuple[Any, float] = (None, 0.0)
        for cb in self.callbacks:
            if cb.name and cb.name in state.callbacks:
                cb.load_state_dict(state.callbacks[cb.name])

    # -- for callbacks ---------------------------------------------------------------------------------

    def gather(self, hook: str, *args: Any) -> list[Any]:
        """Every callback's answer to ``hook`` (a :class:`Callback` method), in callback order."""
        return [getattr(cb, hook)(*args) for cb in self.callbacks]

    def flops_per_step(self) -> float:
        """Training FLOPs of one optimizer step of the model trained now (it changes with a growth)."""
        if self._flops[0] is not self.cfg.model:
            from pretrain.model import flops_per_token

            per_token = flops_per_token(self.cfg.model, self.plan.seq_len, self.cfg.moe)
            self._flops = (self.cfg.model, per_token * self.plan.tokens_per_step)
        return self._flops[1]

    def end_step(self) -> None:
        """Skip the remaining callbacks' ``on_step_end`` of this step (after a rollback restored an older step)."""
        self._step_ended = True

    def stop(self, reason: str) -> None:
        """End the run after this step (validation and a final checkpoint still happen)."""
        self.stop_reason = reason

    def emit(self, event: str, *args: Any) -> None:
        for cb in self.callbacks:
            if event == "on_step_end" and self._step_ended:
                break
            with loop_range(f"{type(cb).__name__}.{event}"):
                getattr(cb, event)(self, *args)

    def collect_state(self) -> None:
        """Put every stateful callback's state into ``state`` (before a checkpoint is written)."""
        for cb in self.callbacks:
            sd = cb.state_dict()
            if cb.name and sd is not None:
                self.state.callbacks[cb.name] = sd

    # -- the loop --------------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        cfg, plan, state = self.cfg, self.plan, self.state
        t = cfg.train
        micro_ids = plan.micro_batch_ids(self.ctx.rank)
        if state.step and not state.flops:  # a checkpoint written before FLOPs were counted: the current model's
            state.flops = state.step * self.flops_per_step()
        self.emit("on_run_start")
        while state.step < t.max_steps and not self.stop_reason:
            torch.manual_seed(step_seed(t.seed, state.step, self.ctx.rank))
            t_fetch = time.perf_counter()
            with loop_range("next_batch"):
                batch = self._next_batch()
            self.shared.data_wait_s = time.perf_counter() - t_fetch
            if batch is None:
                self.progress.say(f"data exhausted at step {state.step} (data.repeat=false): stopping")
                break
            if state.step + 1 < t.max_steps:  # the next batch is fetched while this step computes
                self.batches.prefetch()
            step_no = state.step + 1
            self.emit("on_step_start", step_no)
            lr = self.module.lr_at(state.step)
            for cb in self.callbacks:
                lr *= cb.lr_factor(step_no)
            seeds = dropout_seeds(t.seed, state.step, micro_ids, plan.dims, self.ctx.rank)
            with loop_range("run_step"):
                result = run_step(self.module, StepInput(step_no, batch, lr, seeds), self.callbacks)
            state.step += 1
            state.tokens_seen += plan.tokens_per_step
            state.flops += self.flops_per_step()
            state.sequences += plan.global_batch
            state.last_train_loss = result.loss
            self._step_ended = False
            self.emit("on_step_end", result)
        final: dict[str, Any] = {
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "final_train_loss": state.last_train_loss,
        }
        self.emit("on_run_end", final)
        return final

    def _next_batch(self) -> dict | None:
        """This rank's share of the next global batch, or None when any rank's data ran out."""
        if self.cfg.data.repeat:  # streams restart: no rank can run dry, no extra collective per step
            return self.batches.next_step()
        try:
            batch, exhausted = self.batches.next_step(), 0.0
        except StopIteration:
            batch, exhausted = None, 1.0
        if dist.all_reduce_sum([exhausted], self.ctx.device)[0] > 0:
            if batch is not None:  # another rank's data ended: this step never trains, its batch goes back
                self.batches.rewind()
            return None
        return batch


def is_last_step(trainer: Trainer) -> bool:
    """The run's final step (``train.max_steps``) has just run."""
    return trainer.state.step == trainer.cfg.train.max_steps


def stopped_early(trainer: Trainer) -> bool:
    """The run ends before ``train.max_steps`` (a stop or an early stop), after at least one step."""
    return 0 < trainer.state.step < trainer.cfg.train.max_steps
