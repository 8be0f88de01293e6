"""The loop's side of stability control (``pretrain/train/stability/control.py``): what a rollback puts back. The
decisions are in ``test_monitor.py``; rollbacks in real training in
``tests/integration/train/test_stability_faults.py``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pretrain.checkpoint import layout
from pretrain.checkpoint import store as ckpt_store
from pretrain.train.stability.control import StabilityControl
from pretrain.train.trainer import TrainerState
from tests.harness import tiny_config


class _Tracker:
    def log_metrics(self, metrics, step) -> None: ...

    def set_tags(self, tags) -> None: ...

    def log_json(self, obj, path) -> None: ...


@pytest.mark.parametrize(
    "saved,flops",
    [
        ({"step": 4, "tokens_seen": 512, "flops": 1.0e9, "sequences": 32}, 1.0e9),
        ({"step": 4, "tokens_seen": 512, "sequences": 32}, 2.0e9 / 9 * 4),  # written before FLOPs were counted
    ],
)
def test_a_rollback_restores_the_step_tokens_and_flops_of_its_checkpoint(tmp_path, monkeypatch, saved, flops):
    """Rolled back from step 9 to the checkpoint of step 4: the step, tokens seen and FLOPs are the checkpoint's (the
    FLOPs per step so far times 4 for a checkpoint without them); the sequences stay where the data stream is."""
    ckpt = tmp_path / "good"
    ckpt.mkdir()
    (ckpt / layout.TRAINER_STATE).write_text(json.dumps(saved))
    monkeypatch.setattr(ckpt_store, "open_committed", lambda p: SimpleNamespace(path=Path(p), step=4, manifest=None))
    state = TrainerState(step=9, tokens_seen=1152, flops=2.0e9, sequences=72)
    cfg = tiny_config("stability.policy=rollback", "stability.good_after_steps=0")
    control = StabilityControl(
        cfg, state, SimpleNamespace(is_main=True), tmp_path, _Tracker(), SimpleNamespace(say=lambda line: None)
    )
    control.monitor.note_checkpoint(4, str(ckpt), 32)
    loaded = []
    assert control.rollback(loaded.append, 9) == ckpt
    assert [c.path for c in loaded] == [ckpt]
    assert (state.step, state.tokens_seen, state.sequences) == (4, 512, 72)
    assert state.flops == pytest.approx(flops, rel=1e-12)


def test_an_event_mlflow_refuses_is_a_warning_and_its_timeline_is_sent_later(tmp_path):
    """A tracking server down at an event: the tag and the timeline upload fail as a warning (the run trains on),
    and the timeline stays to be sent at the next flush."""
    from mlflow.exceptions import MlflowException

    class Down(_Tracker):
        up, timelines = False, 0

        def set_tags(self, tags) -> None:
            if not self.up:
                raise MlflowException("API request failed: max retries")

        def log_json(self, obj, path) -> None:
            self.set_tags({})
            self.timelines += 1

    lines: list[str] = []
    tracker = Down()
    main, progress = SimpleNamespace(is_main=True), SimpleNamespace(say=lines.append)
    control = StabilityControl(tiny_config(), TrainerState(), main, tmp_path, tracker, progress)
    control.report({"event": 1, "step": 3, "kind": "loss_spike", "action": "skip", "detail": ""}, urgent=True)
    assert [line for line in lines if line.startswith("warning: MLflow did not take")] == lines[1:] and len(lines) == 3
    tracker.up = True
    control.flush()
    assert tracker.timelines == 1
