"""A stop is a checkpoint: the driver's handling of SIGTERM and SIGINT while a job trains.

The first signal asks the workers to stop: it writes ``RUN_DIR/stop_request.json`` (the run directory is shared by
every node), which rank 0 reads at each step boundary and every rank learns with one collective
(:class:`pretrain.train.callbacks.stopping.StopOnRequest`). Every rank then finishes its step, the run commits a
checkpoint at that step and ends as a finished run would, with ``stopped`` in its summary. A second signal, or
``checkpoint.stop_timeout_s`` without the run having ended, ends it at once (:class:`StopNow`); so does the first
signal with ``checkpoint.on_stop: exit``.

The same request serves a job of one worker in this process, Ray Train's workers, and a submitted job, whose
driver gets SIGTERM from ``./launch.sh stop JOB`` (Ray Jobs' stop).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from pretrain.train.stop_request import StopNow, clear_request, write_request

__all__ = ["SIGNALS", "StopNow", "StopSignals", "exit_code", "stop_at_once"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by ``signum`` (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + signum


class StopSignals:
    """``with StopSignals(run_dir, on_stop, timeout_s):`` SIGTERM and SIGINT ask the run to stop (see the module);
    on the way out the previous handlers are back and the request is gone. ``signame`` is the first signal's name
    (SIGTERM, SIGINT), empty when none came. Only in the main thread (Python runs signal handlers there)."""

    def __init__(self, run_dir: Path | str, on_stop: str = "save", timeout_s: float = 300.0) -> None:
        self.run_dir, self.on_stop, self.timeout_s = Path(run_dir), on_stop, timeout_s
        self.signum = 0
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def __enter__(self) -> StopSignals:
        clear_request(self.run_dir)
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        clear_request(self.run_dir)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            raise StopNow(self.signum, f"{name} again: stopping at once")
        self.signum = signum
        if self.on_stop == "exit":
            raise StopNow(signum, f"{name}: stopping at once (checkpoint.on_stop: exit)")
        try:
            write_request(self.run_dir, name)
        except OSError as e:  # (raised here, it would surface anywhere in the training loop: a crash, not a stop)
            raise StopNow(signum, f"{name}: cannot ask the run to stop ({e}): stopping at once") from e
        _say(
            f"[pretrain] {name}: stopping after the current step with a checkpoint "
            f"(at most {self.timeout_s:g} s: checkpoint.stop_timeout_s; {name} again stops at once)"
        )
        self._timer = threading.Timer(self.timeout_s, os.kill, args=(os.getpid(), signum))
        self._timer.daemon = True
        self._timer.start()


@contextlib.contextmanager
def stop_at_once() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`StopNow` while the block runs (in the main thread): before a run trains there
    is nothing to checkpoint, so a stop ends the command (exit 143 or 130) and the run, if created, ends ``KILLED``
    (:func:`pretrain.driver.prepare.ended_on_error`, :func:`pretrain.driver.run_job.run_job`). A
    :class:`StopSignals` entered inside it takes over until it exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        raise StopNow(signum, f"{signal.Signals(signum).name}: stopped at once")

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _say(line: str) -> None:
    """One line on stderr from a signal handler (``print`` may be in the middle of a write it interrupted)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass
