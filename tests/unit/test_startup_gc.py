"""The garbage collector paused during a training process's start-up (:mod:`pretrain.startup_gc`)."""

from __future__ import annotations

import gc
import weakref

import pytest

from pretrain import startup_gc


@pytest.fixture(autouse=True)
def _collector_on():
    assert gc.isenabled()
    yield
    startup_gc.resume()
    gc.enable()


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_pause_stops_automatic_collection_and_resume_collects_what_start_up_left():
    startup_gc.pause()
    assert not gc.isenabled() and startup_gc.paused()
    garbage = _cycle()
    kept = [_Node() for _ in range(50_000)]  # far past every generation's threshold (on: collected by now)
    assert garbage() is not None, "collected while paused"
    del kept
    startup_gc.resume()
    assert gc.isenabled() and not startup_gc.paused()
    assert garbage() is None, "start-up's unreachable cycles are freed when collection resumes"


def test_resume_without_pause_and_a_disabled_collector_are_left_alone():
    startup_gc.resume()  # library use: nothing paused, nothing collected or changed
    assert gc.isenabled()
    gc.disable()  # a process that turned collection off itself keeps it off
    startup_gc.pause()
    startup_gc.resume()
    assert not gc.isenabled()


def test_a_training_command_pauses_only_train_and_resume(monkeypatch):
    import pretrain.__main__ as entry

    for argv, want in (
        (["pretrain", "train"], True),
        (["pretrain", "resume", "x"], True),
        (["pretrain", "export", "x"], False),
        (["pretrain"], False),
    ):
        monkeypatch.setattr("sys.argv", argv)
        assert entry.pauses_collection() is want, argv
