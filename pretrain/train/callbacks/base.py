"""The callback contract: the :class:`Callback` base, every hook it offers, and the :class:`Shared` blackboard.

A behaviour of the loop (a schedule, a monitor, a save) is a callback; the loop itself
(:class:`pretrain.train.trainer.Trainer`) only schedules steps and emits the events below. The standard set of a run
is declared in :mod:`pretrain.train.callbacks.standard` (its docstring lists it in order).

Order
    Every event goes to every callback, one after the other, in ascending ``order`` (an int, 100 by default);
    callbacks of equal ``order`` keep the order of the list the trainer was given (a stable sort: the standard
    set's declared order, then ``build_trainer``'s extra callbacks). The order is the same for every event,
    ``on_run_end`` included (no reversal), for the step hooks inside ``run_step``, and for the answers of
    :meth:`Trainer.gather <pretrain.train.trainer.Trainer.gather>`. A lower ``order`` runs earlier: a callback
    that others depend on within the same event (validation before the early stop that reads its loss) gets the
    lower number.

Events, in the order a run emits them (``trainer`` is the running :class:`~pretrain.train.trainer.Trainer`)::

    load_state_dict(state)                 when the trainer is built: the state saved under ``name``, if any
    on_run_start(trainer)                  once, before the first step (after a resume was restored)
    per step:
        (the batch is fetched: ``trainer.shared.data_wait_s`` is its wait)
        on_step_start(trainer, step)       ``step``: the 1-based number of the step about to run
            on_model_changed(trainer)      nested: emitted by a callback that rebuilt the module (growth)
        lr_factor(step)                    every callback's factor multiplies the scheduled LR (in order)
        run_step(module, input, hooks=callbacks), the step hooks of :class:`~pretrain.train.step.StepHooks`:
            per micro-batch:  before_forward, forward_kwargs (one pass over the callbacks: each callback's
                              before_forward then its forward_kwargs), forward, after_forward, objective, backward
            after_backward                 after the last backward
            decide                         from the all-reduced loss and gradient norm; the first answer that is
                                           not None is the step's decision (later callbacks are not asked)
            before_update                  after the decision, right before the optimizer update
            after_update                   right after the update (or the skipped update)
        (counters advanced: ``trainer.state.step`` is now ``step``)
        on_step_end(trainer, result)       may be cut short: ``trainer.end_step()`` skips the later callbacks
            on_rollback(trainer)           nested: the stability guard is about to restore a checkpoint
            on_halt(trainer)               nested: the stability guard is about to end the run (its halt)
            on_validation(trainer, metrics)      nested: validation ran (ValidationCallback)
            on_nonfinite_weights(trainer, step)  nested: a save found NaN/Inf weights (nothing was written)
            on_checkpoint(trainer, path)   nested: a checkpoint was saved (CheckpointCallback)
            state_dict()                   nested: before each checkpoint write (``trainer.collect_state()``)
    on_run_end(trainer, final)             once, after the last step (or a stop); validation and a final
                                           checkpoint may still happen inside it (nested events as above)

A nested event is emitted from inside another callback's hook (``trainer.emit``): every callback sees it, in
order, before the emitting hook returns; e.g. ``on_validation`` reaches every callback while ValidationCallback
(order 40) is inside its ``on_step_end``, before the callbacks after it get their ``on_step_end``.
:meth:`Trainer.gather <pretrain.train.trainer.Trainer.gather>` asks every callback the same question at any time
(``extra_metrics`` at a logged step, ``protected_paths`` when a save prunes).

What a hook may change: the counters in ``trainer.state`` belong to the loop (a rollback restores them);
``trainer.module`` and ``trainer.cfg`` change only through ``trainer.module.rebuild`` followed by
``on_model_changed``; ``trainer.stop(reason)`` ends the run after the current step; ``trainer.last_checkpoint`` is
set by whoever commits or restores a checkpoint; each field of ``trainer.shared`` has one writer. Callbacks never
look each other up or import each other: what one offers the others goes through the trainer (``shared``, the
events, ``gather``); ``tests/unit/train/test_trainer.py`` checks the source for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from pretrain.train.step import StepHooks, StepResult

TrainerArg: TypeAlias = Any
"""The running :class:`pretrain.train.trainer.Trainer`. Not imported here: the trainer imports this module, and no
import cycle is allowed (``tests/unit/house/test_import_cycles.py`` counts ``TYPE_CHECKING`` imports too); a callback
annotates its hooks' ``trainer`` as ``Trainer``."""


@dataclass
class Shared:
    """What callbacks publish for each other, typed (a callback never looks another up by type): the trainer's
    ``trainer.shared``. Each field has one writer; any callback may read it."""

    skipped_blocks: frozenset[int] = frozenset()
    """Blocks that do no work in the current step (layer dropout in ``layer`` mode; set at ``on_step_start``)."""
    last_event_step: int = 0
    """Step of the latest stability event, 0 before any (the stability guard; current from its ``on_step_end``)."""
    data_wait_s: float = 0.0
    """Seconds the current step waited for its batch (the trainer; set before ``on_step_start``)."""
    step_s: float = 0.0
    """Seconds the current step took, from its start to its end, the work of other callbacks at either end left out
    (the speed monitor; set first in ``on_step_end``): what tokens/s and MFU are both measured over."""


class Callback(StepHooks):
    """Base of the trainer's callbacks: every hook is a no-op, so a callback overrides only what it uses.

    The events and their order are in this module's docstring; the step hooks (``before_forward``,
    ``forward_kwargs``, ``after_forward``, ``objective``, ``after_backward``, ``decide``, ``before_update``,
    ``after_update``) are inherited from :class:`pretrain.train.step.StepHooks`, where each is documented."""

    order: int = 100
    """Position among the callbacks, ascending: every event, step hook and ``gather`` goes to a lower ``order``
    first; equal orders keep the order of the trainer's list. Each callback class declares its own."""
    name: str = ""
    """The key of this callback's state in every checkpoint (``trainer_state.json``: ``callbacks.<name>``); empty:
    stateless. A name never changes once released: older checkpoints find their state under it."""

    def on_run_start(self, trainer: TrainerArg) -> None:
        """Once, before the first step, after a resume has restored the module, the data position, the counters
        and this callback's state (``load_state_dict``). ``trainer.last_checkpoint`` is the checkpoint resumed from
        (None for a new run). Set up what the steps need (clocks, samplers, the device peak)."""

    def on_step_start(self, trainer: TrainerArg, step: int) -> None:
        """Before each step's LR and ``run_step``: the batch is fetched (``trainer.shared.data_wait_s``) and
        ``step`` (1-based) is the step about to run; ``trainer.state.step`` is still ``step - 1``. May set the
        step's schedule (layer-drop gates, ``trainer.shared.skipped_blocks``) or replace the model
        (``trainer.module.rebuild``, ``trainer.cfg``, then ``trainer.emit("on_model_changed")``)."""

    def lr_factor(self, step: int) -> float:
        """A factor of step ``step``'s learning rate: the scheduled LR times every callback's factor (in order) is
        the LR of the update (a re-warm, a cool-down, an injected spike). 1.0: no opinion."""
        return 1.0

    def on_step_end(self, trainer: TrainerArg, result: StepResult) -> None:
        """After ``run_step``; the counters are advanced (``trainer.state.step`` is the step that ran,
        ``tokens_seen``, ``flops``, ``sequences``, ``last_train_loss``). ``result``: the mean loss, the gradient norm,
        whether the update was applied, the decision, the MoE statistics. Log, validate, save, stop
        (``trainer.stop``). A callback that restored an older step (a rollback) calls ``trainer.end_step()``:
        the callbacks after it get no ``on_step_end`` for this step."""

    def on_model_changed(self, trainer: TrainerArg) -> None:
        """``trainer.module`` now holds another architecture (``trainer.cfg`` is the new config): emitted inside
        ``on_step_start`` by the callback that rebuilt it. Forget what belongs to the old model (rollback targets,
        FLOPs per token)."""

    def on_validation(self, trainer: TrainerArg, metrics: dict[str, float]) -> None:
        """After each validation (``metrics``: ``val/*``, also ``trainer.state.last_val``), emitted inside
        ValidationCallback's ``on_step_end`` or ``on_run_end``. Add evaluations of the same step, stop early."""

    def on_checkpoint(self, trainer: TrainerArg, path: Path) -> None:
        """A checkpoint of this step was saved at ``path`` (its contents are fixed): committed now (synchronous) or
        at a later step boundary (``checkpoint.async``); ``trainer.last_checkpoint`` is the newest committed one.
        Emitted inside CheckpointCallback's ``on_step_end`` or ``on_run_end``. Read only."""

    def on_rollback(self, trainer: TrainerArg) -> None:
        """A committed checkpoint is about to be restored into the running job (a stability rollback), emitted
        inside the stability guard's ``on_step_end``: finish what depends on the current state (CheckpointCallback
        commits a save in flight first, its target may be that one)."""

    def on_halt(self, trainer: TrainerArg) -> None:
        """The stability guard is about to end the run (its ``halt`` policy; every rank at the same step), emitted
        inside its ``on_step_end``: finish what must outlive the run (CheckpointCallback commits a save in flight)."""

    def on_nonfinite_weights(self, trainer: TrainerArg, step: int) -> None:
        """A save at ``step`` found NaN/Inf weights; nothing was written (emitted inside CheckpointCallback's
        save). The stability guard decides what happens."""

    def on_run_end(self, trainer: TrainerArg, final: dict[str, Any]) -> None:
        """Once, after the last step or a stop (``trainer.stop_reason``), before ``fit`` returns; not after an
        exception. ``final``: the run's summary (``step``, ``tokens_seen``, ``final_train_loss`` to start with):
        callbacks add their keys; later callbacks see what earlier ones added (RunSummary, last, writes
        ``summary.json``). A run that stopped early still validates and saves here (nested events)."""

    def extra_metrics(self) -> dict[str, float]:
        """Metrics this callback adds to each logged ``train/*`` line (MetricsLogger gathers them at every logged
        step, inside its ``on_step_end``). Read only."""
        return {}

    def protected_paths(self) -> set[str]:
        """Committed checkpoints that pruning must keep (gathered when CheckpointCallback's save prunes: e.g. the
        rollback target). Read only."""
        return set()

    def state_dict(self) -> dict[str, Any] | None:
        """This callback's state, saved in every checkpoint under ``name`` (``trainer.collect_state()``, right
        before each checkpoint write). None (or an empty ``name``): nothing saved. JSON-serializable."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The state saved under ``name`` by the checkpoint this run resumes from, handed back once when the trainer
        is built (before ``on_run_start``); not called when the checkpoint holds none."""
