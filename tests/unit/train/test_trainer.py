"""The trainer's core has no feature special cases: ``TrainerState`` holds counters plus every callback's own
``state_dict()`` (stability and fault injection included; older checkpoints migrate on load), and callbacks never
look each other up: what one offers the others goes through the trainer (``shared``, events, ``gather``)."""

from __future__ import annotations

import ast
import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain.checkpoint import layout
from pretrain.config import load_config
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.checkpoint import CheckpointCallback
from pretrain.train.callbacks.fault_injection import FaultInjection
from pretrain.train.callbacks.metrics import MetricsLogger
from pretrain.train.callbacks.stability import StabilityCallback
from pretrain.train.stability.monitor import StabilityMonitor, StepSignals
from pretrain.train.trainer import Trainer, TrainerState

ROOT = Path(__file__).resolve().parents[3]


def _trainer(callbacks: list[Callback], state: TrainerState) -> Trainer:
    """A trainer without a module or data: what loading and collecting callback state needs."""
    cfg = load_config(None, ["faults.loss_spike_at_step=3", "train.max_steps=20"])
    return Trainer(
        cfg=cfg,
        plan=None,
        ctx=None,
        module=None,
        batches=None,
        val_set=[],
        state=state,
        tracker=None,
        progress=SimpleNamespace(say=lambda line: None),
        run_dir=Path("."),
        callbacks=callbacks,
    )


def _callbacks() -> tuple[StabilityCallback, FaultInjection]:
    cfg = load_config(None, ["faults.loss_spike_at_step=3", "train.max_steps=20", "stability.policy=rollback"])
    control = SimpleNamespace(monitor=StabilityMonitor(cfg.stability, cfg.moe))
    return StabilityCallback(control), FaultInjection(cfg)


def _old_trainer_state() -> dict:
    """A trainer_state.json as written before callbacks owned their state: stability and fired faults at the top."""
    cfg = load_config(None, [])
    monitor = StabilityMonitor(cfg.stability, cfg.moe)
    for step in range(1, 40):
        monitor.decide(StepSignals(step, 5.0 - 0.01 * step, 1.0))
    monitor.note_checkpoint(30, "/runs/r/step_00000030", 240)
    monitor.decide(StepSignals(40, float("nan"), float("nan")))  # an event: a skipped step
    return {
        "step": 40,
        "tokens_seen": 40 * 512,
        "last_train_loss": 4.6,
        "last_val": {"val/loss": 4.7},
        "sequences": 320,
        "stability": json.loads(json.dumps(monitor.state_dict())),
        "faults_fired": ["loss_spike"],
        "callbacks": {"growth": {"applied": [0], "last_growth_step": 12}},
    }


def test_an_old_trainer_state_migrates_to_callback_states():
    old = _old_trainer_state()
    assert old["stability"]["events_total"] == 1 and old["stability"]["checkpoints"]
    state = TrainerState.from_dict(old)
    stability, faults = _callbacks()
    trainer = _trainer([faults, stability], state)
    assert stability.monitor.state_dict() == old["stability"], "the stability state is the callback's again"
    assert faults.fired == ["loss_spike"] and not faults._fire(trainer, "loss_spike", 3, 3), "no replay"
    assert state.step == 40 and state.sequences == 320 and state.last_val == {"val/loss": 4.7}
    trainer.collect_state()
    saved = json.loads(json.dumps(asdict(state)))  # what a checkpoint writes now
    assert "stability" not in saved and "faults_fired" not in saved
    assert saved["callbacks"] == {
        "growth": {"applied": [0], "last_growth_step": 12},
        "stability": old["stability"],
        "faults_fired": {"fired": ["loss_spike"]},
    }
    # ... and the new format loads back into fresh callbacks unchanged.
    stability2, faults2 = _callbacks()
    _trainer([stability2, faults2], TrainerState.from_dict(saved))
    assert stability2.monitor.state_dict() == old["stability"] and faults2.fired == ["loss_spike"]


def test_callbacks_publish_through_the_trainer():
    """Metrics, protected checkpoints and the latest event reach other callbacks without a lookup by type."""
    stability, faults = _callbacks()
    stability.monitor.note_checkpoint(8, "/runs/r/step_00000008", 64)
    for step in range(9, 9 + stability.monitor.cfg.good_after_steps + 1):
        stability.monitor.decide(StepSignals(step, 3.0, 1.0))
    trainer = _trainer([stability, faults, MetricsLogger()], TrainerState())
    assert set().union(*trainer.gather("protected_paths")) == {"/runs/r/step_00000008"}
    metrics: dict[str, float] = {}
    for extra in trainer.gather("extra_metrics"):
        metrics.update(extra)
    assert metrics == {"stability/events": 0.0, "stability/skipped_steps": 0.0, "stability/rollbacks": 0.0}
    stability.on_run_start(trainer)
    assert trainer.shared.last_event_step == stability.monitor.s.last_event_step
    trainer.emit("on_model_changed")  # growth: no rollback to checkpoints of the old architecture
    assert trainer.gather("protected_paths") == [set(), set(), set()]


class _SlowCommits:
    """A checkpointer whose commits never finish between steps: each save stays in flight until the next
    :meth:`finish` (what the real :class:`~pretrain.train.checkpointer.Checkpointer` does when committing takes
    longer than the steps between saves, as on a loaded machine)."""

    def __init__(self) -> None:
        self.in_flight: Path | None = None
        self.writer = SimpleNamespace(settle=lambda: None, record_pending=lambda: [])

    def summary(self) -> dict:
        return {}

    def warm(self, module) -> None:
        pass

    def poll(self) -> None:
        return None

    def finish(self) -> Path | None:
        flight, self.in_flight = self.in_flight, None
        return flight

    def save(self, module, batches, state, protect) -> Path:
        self.finish()  # as the real one: at most one save in flight
        self.in_flight = Path(layout.step_dir_name(state.step))
        return self.in_flight


def test_a_save_still_in_flight_when_the_next_starts_is_committed_and_said():
    said: list[str] = []
    callback = CheckpointCallback(_SlowCommits())
    trainer = _trainer([callback], TrainerState())
    trainer.progress = SimpleNamespace(say=said.append)
    trainer.cfg = load_config(None, ["train.max_steps=6", "checkpoint.every_steps=2"])
    for step in range(1, 7):
        trainer.state.step = step
        callback.on_step_end(trainer, None)
    assert said == ["checkpoint committed: step 2", "checkpoint committed: step 4"]
    assert trainer.last_checkpoint == Path(layout.step_dir_name(4))
    callback.on_run_end(trainer, final := {})
    assert said[-1] == "checkpoint committed: step 6" and final["checkpoint"] == layout.step_dir_name(6)


def test_a_stop_whose_save_in_flight_failed_saves_at_the_stop():
    """A stop is a checkpoint: when the asynchronous save still in flight failed (its one-line error on every
    rank), the stop's own save is still made and the run ends with it; at the end of a whole run the error stands."""
    from pretrain.checkpoint.store import CheckpointError

    class _FailedFlight(_SlowCommits):
        def finish(self) -> Path | None:
            flight = super().finish()
            if flight is not None and flight.name == layout.step_dir_name(4):
                raise CheckpointError("checkpoint at step 4 failed: OSError: [Errno 5] Input/output error")
            return flight

    for max_steps, stops in ((8, True), (5, False)):
        said: list[str] = []
        callback = CheckpointCallback(_FailedFlight())
        trainer = _trainer([callback], TrainerState())
        trainer.progress = SimpleNamespace(say=said.append)
        trainer.cfg = load_config(None, [f"train.max_steps={max_steps}", "checkpoint.every_steps=4"])
        for step in range(1, 5):
            trainer.state.step = step
            callback.on_step_end(trainer, None)
        trainer.state.step = 5  # stopped at step 5 of 8 (or the last step of 5)
        if not stops:
            with pytest.raises(CheckpointError, match="checkpoint at step 4 failed"):
                callback.on_run_end(trainer, {})
            continue
        callback.on_run_end(trainer, final := {})
        assert (
            said[0]
            == "warning: checkpoint at step 4 failed: OSError: [Errno 5] Input/output error; saving at the stop instead"
        )
        assert final["checkpoint"] == layout.step_dir_name(5) and callback.at_stop


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        return [node.module]
    return []


def lookups(train: Path) -> list[str]:
    """Back doors between callbacks in the modules of ``train``: ``trainer.find``, a function-level import of a
    module that defines callbacks, or ``getattr``/``hasattr``/``isinstance`` on the loop variable over callbacks."""

    def module(f: Path) -> str:
        return ".".join(("pretrain", "train", *f.relative_to(train).with_suffix("").parts))

    callback_modules = {
        module(f)
        for f in train.rglob("*.py")
        if any(
            isinstance(n, ast.ClassDef) and any(getattr(b, "id", "") == "Callback" for b in n.bases)
            for n in ast.walk(ast.parse(f.read_text()))
        )
    }
    assert {
        "pretrain.train.callbacks.checkpoint",
        "pretrain.train.callbacks.growth",
        "pretrain.train.callbacks.layer_drop",
        "pretrain.train.callbacks.metrics",
    } <= callback_modules
    offenders = []
    for f in sorted(train.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            offenders += [
                f"{f.name}:{n.lineno} lazy import of {m}"
                for n in ast.walk(fn)
                for m in _imported(n)
                if m in callback_modules
            ]
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr == "find" and getattr(n.value, "id", "") == "trainer":
                offenders.append(f"{f.name}:{n.lineno} trainer.find")
            loops = (
                [(n, n.target, n.iter)]
                if isinstance(n, ast.For)
                else [(n, g.target, g.iter) for g in getattr(n, "generators", [])]
            )  # comprehensions
            for scope, target, over in loops:
                if (
                    f.name == "trainer.py"
                    or not isinstance(target, ast.Name)
                    or getattr(over, "attr", "") != "callbacks"
                ):  # the trainer dispatches hooks by name
                    continue
                offenders += [
                    f"{f.name}:{c.lineno} {ast.unparse(c)}"
                    for c in ast.walk(scope)
                    if isinstance(c, ast.Call)
                    and getattr(c.func, "id", "") in ("getattr", "hasattr", "isinstance")
                    and c.args
                    and getattr(c.args[0], "id", None) == target.id
                ]
    return offenders


def test_callbacks_never_look_each_other_up_or_import_each_other_lazily():
    offenders = lookups(ROOT / "pretrain" / "train")
    assert not hasattr(Trainer, "find")
    assert not offenders, "\n".join(offenders)
