"""Where the time to a run's first step goes: wall-clock marks of the start-up phases.

The command marks the beginning of each phase with :func:`enter` (``run_preparation``, ``tokenizer``, ``ray``,
``worker_setup``, ``engine_build``, ...); a phase lasts until the next one begins, so the phases add up to the
whole time from the command's start (the process start, read from ``/proc``: under ``./launch.sh`` that is the
launcher's start, since it ``exec``s Python) to the end of the first completed step. The driver's marks travel
to the workers in the ``Job``; the worker that completes the first step reports them (``SpeedMonitor``: a
progress line, ``summary.json``). Wall-clock (``time.time``) marks, so driver and worker marks compare on one
machine; across nodes they are as good as the clocks' sync.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

_IMPORTED_AT = time.time()

_marks: list[tuple[str, float]] = []
_quiet = threading.local()

PHASES = (
    "imports",
    "run_preparation",
    "tokenizer",
    "ray",
    "worker_setup",
    "engine_build",
    "trainer_setup",
    "first_batch",
    "first_step",
)
"""The phases a training command goes through, in order (``ray`` only when it runs through Ray; then the run's
preparation, ``tokenizer`` included, overlaps Ray's start and only a wait for its end counts as
``run_preparation``)."""


def process_start() -> float:
    """Wall-clock time at which this process started (Linux: from ``/proc``; elsewhere: when this module was
    imported, which is within the interpreter's start-up)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22 (starttime), after the comm field
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def start(name: str = "imports", at: float | None = None) -> None:
    """Begin the timeline (forgetting any earlier one) with phase ``name`` at ``at`` (default: the process start)."""
    _marks.clear()
    _marks.append((name, process_start() if at is None else at))


def enter(phase: str) -> None:
    """Phase ``phase`` begins now (the previous one ends); a no-op outside a timeline (library use, tests) and in
    work running alongside another phase (:func:`quietly`)."""
    if _marks and not getattr(_quiet, "on", False):
        _marks.append((phase, time.time()))


def quietly(fn: Callable[[], Any]) -> Any:
    """``fn()`` without marking phases (in a thread, overlapping the phase the main thread is in)."""
    _quiet.on = True
    try:
        return fn()
    finally:
        _quiet.on = False


def finish() -> None:
    """End the timeline (after the first step): later runs in this process start their own."""
    _marks.clear()


def marks() -> list[tuple[str, float]]:
    """The marks so far, oldest first: ``(phase, wall-clock begin)``; plain data for the ``Job``."""
    return list(_marks)


def adopt(marks_: list) -> None:
    """Continue the timeline a driver handed over (a worker; in the driver's own process a no-op)."""
    if marks_ and [tuple(m) for m in marks_] != _marks[: len(marks_)]:
        _marks[:] = [(str(p), float(t)) for p, t in marks_]


def phases(marks_: list, end: float) -> dict[str, float]:
    """Seconds per phase up to ``end`` (a phase entered more than once adds up), in order of first entry."""
    out: dict[str, float] = {}
    for (phase, begin), (_, nxt) in zip(marks_, [*marks_[1:], ("", end)]):
        out[phase] = out.get(phase, 0.0) + max(nxt - begin, 0.0)
    return out
