"""The standard callbacks come from one declaration (``STANDARD`` in ``pretrain/train/callbacks/standard.py``): sorted
by the order each class declares, listed in the same order by the module's docstring table and by the callbacks table
of ``docs/architecture.md``, and assembled (the enabled ones) in that order."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain.config import load_config
from pretrain.train.callbacks import standard
from pretrain.train.callbacks.standard import STANDARD, RunParts, standard_callbacks
from pretrain.train.stability.monitor import StabilityMonitor

ROOT = Path(__file__).resolve().parents[4]


def _declared() -> list[tuple[int, str]]:
    return [(slot.cls.order, slot.cls.__name__) for slot in STANDARD]


def test_every_standard_callback_declares_its_order_and_the_declaration_is_sorted():
    for slot in STANDARD:
        assert "order" in vars(slot.cls), f"{slot.cls.__name__} does not declare its order"
    orders = [order for order, _ in _declared()]
    assert orders == sorted(orders)
    assert len({slot.cls for slot in STANDARD}) == len(STANDARD)


def _docstring_rows() -> list[tuple[int, str, str]]:
    """(order, class, text of the row and its continuation lines) of the docstring's table."""
    doc = standard.__doc__ or ""
    rows: list[tuple[int, str, str]] = []
    for line in doc.splitlines():
        m = re.match(r"^(\d+)\s+(\w+)\s+(.*)$", line)
        if m:
            rows.append((int(m.group(1)), m.group(2), m.group(3)))
        elif rows and re.match(r"^\s{20,}\S", line):  # a continuation of the row's last column
            rows[-1] = (rows[-1][0], rows[-1][1], rows[-1][2] + " " + line.strip())
    return rows


def test_the_docstring_table_lists_the_standard_set_in_order():
    rows = _docstring_rows()
    assert [(order, name) for order, name, _ in rows] == _declared()
    for (_, name, text), slot in zip(rows, STANDARD):
        module = slot.cls.__module__.rsplit(".", 1)[-1] + ".py"
        assert module in text, f"{name}: its row does not name its module {module}"


def test_the_architecture_doc_lists_the_standard_set_in_order():
    """The callbacks table of docs/architecture.md: one row per order, the callbacks of that order with their
    modules, e.g. ``| 2 | SystemMetrics (`system_metrics.py`), ... | ... |``."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = re.match(r"^\| (\d+) \| (.*?) \| .* \|$", line)
        if m:
            for name, module in re.findall(r"(\w+) \(`(\w+\.py)`", m.group(2)):
                listed.append((int(m.group(1)), name))
                cls = next(slot.cls for slot in STANDARD if slot.cls.__name__ == name)
                assert cls.__module__.endswith("." + module.removesuffix(".py")), (name, module)
    assert listed == _declared()


def _parts(*overrides: str) -> RunParts:
    cfg = load_config(None, list(overrides))
    return RunParts(
        cfg,
        SimpleNamespace(monitor=StabilityMonitor(cfg.stability, cfg.moe)),
        SimpleNamespace(),
        "",
        SimpleNamespace(micro_batch_ids=lambda rank: [rank]),
        0,
        run_id="run",
        tokenizer=None,
        per_source={},
        only_source="",
        tasks=[],
        hashed_at_setup=SimpleNamespace(),
        data_fingerprint={},
    )


FEATURES = {
    "ProfilerCallback": "train.profile_at=2",
    "SystemMetrics": "tracking.system_metrics=true",
    "GrowthCallback": "growth.rewarm_steps=2",
    "LayerDropCallback": "layer_drop.rate=0.1",
    "EarlyExitCallback": "layer_drop.early_exit.layers=all",
}


def test_the_set_holds_the_enabled_callbacks_in_the_declared_order():
    always = [name for _, name in _declared() if name not in FEATURES]
    assert [type(cb).__name__ for cb in standard_callbacks(_parts())] == always
    every = standard_callbacks(_parts(*FEATURES.values()))
    assert [type(cb).__name__ for cb in every] == [name for _, name in _declared()]


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_each_feature_adds_its_callback(name):
    names = [type(cb).__name__ for cb in standard_callbacks(_parts(FEATURES[name]))]
    assert [n for n in names if n in FEATURES] == [name]


def test_the_checkpointed_names_stay():
    """``trainer_state.json`` keeps each stateful callback's state under its ``name``: older checkpoints resume only
    while these names stay."""
    named = {slot.cls.__name__: slot.cls.name for slot in STANDARD if slot.cls.name}
    assert named == {
        "GrowthCallback": "growth",
        "StabilityCallback": "stability",
        "FaultInjection": "faults_fired",
        "DataFingerprint": "data_fingerprint",
        "LayerDropCallback": "layer_drop_window",
        "EarlyExitCallback": "early_exit_window",
        "MetricsLogger": "metrics_window",
        "CheckpointCallback": "checkpoint",
        "ValidationCallback": "validation",
        "TaskEvaluation": "task_evaluation",
    }
