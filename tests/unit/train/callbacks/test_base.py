"""The callback contract (``pretrain/train/callbacks/base.py``) is complete: every hook of ``Callback`` and of the
step's ``StepHooks`` is documented, every event the code emits or gathers is a hook of the base and named in the
contract's list of events, and callbacks of equal ``order`` keep the order they were given in."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

from pretrain.config import load_config
from pretrain.train.callbacks import base
from pretrain.train.callbacks.base import Callback
from pretrain.train.step import StepHooks
from pretrain.train.trainer import Trainer, TrainerState

ROOT = Path(__file__).resolve().parents[4]


def _hooks(cls: type) -> list[str]:
    return [name for name, value in vars(cls).items() if inspect.isfunction(value) and not name.startswith("_")]


def test_every_hook_is_documented_in_the_contract():
    hooks = _hooks(Callback) + _hooks(StepHooks)
    assert len(hooks) >= 20
    listed = base.__doc__ or ""
    for name in hooks:
        assert inspect.getdoc(getattr(Callback, name)), f"{name} has no docstring"
        assert re.search(rf"\b{name}\b", listed), f"{name} is missing from base.py's list of events"
    body = ast.parse(inspect.getsource(Callback)).body[0].body
    documented = {
        a.target.id
        for a, doc in zip(body, body[1:])
        if isinstance(a, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
    }
    assert {"order", "name"} <= documented


def test_every_emitted_or_gathered_hook_is_part_of_the_contract():
    used = set()
    for f in sorted((ROOT / "pretrain").rglob("*.py")):
        used |= set(re.findall(r"\.(?:emit|gather)\(\s*\"(\w+)\"", f.read_text()))
    assert {"on_validation", "on_checkpoint", "on_model_changed", "extra_metrics"} <= used
    for name in used:
        assert name in _hooks(Callback), f"{name} is emitted or gathered but is no hook of Callback"


class _Probe(Callback):
    def __init__(self, order: int, label: str, seen: list[str]) -> None:
        self.order, self.label, self.seen = order, label, seen

    def on_run_start(self, trainer: Trainer) -> None:
        self.seen.append(self.label)


def test_callbacks_run_in_ascending_order_and_ties_keep_their_given_order():
    seen: list[str] = []
    probes = [_Probe(5, "b1", seen), _Probe(1, "a", seen), _Probe(5, "b2", seen), _Probe(100, "c", seen)]
    trainer = Trainer(
        cfg=load_config(None, []),
        plan=None,
        ctx=None,
        module=None,
        batches=None,
        val_set=[],
        state=TrainerState(),
        tracker=None,
        progress=SimpleNamespace(say=lambda line: None),
        run_dir=Path("."),
        callbacks=[*probes, _Probe(5, "b3", seen)],
    )
    trainer.emit("on_run_start")
    assert seen == ["a", "b1", "b2", "b3", "c"]
    assert [cb.label for cb in trainer.callbacks] == seen
