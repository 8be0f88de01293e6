"""The stop request: ``RUN_DIR/stop_request.json``, written by the driver when it is asked to stop
(:mod:`pretrain.driver.signals`) and read by rank 0 at each step boundary
(:class:`pretrain.train.callbacks.stopping.StopOnRequest`). The run directory is shared by every node, so the request
reaches workers on any node without a channel of its own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from pretrain.checkpoint.layout import STOP_REQUEST


class StopNow(KeyboardInterrupt):
    """The run ends at once, with no new checkpoint (a second signal, the stop's time limit,
    ``checkpoint.on_stop: exit``, or a stop before the run trains); the command exits ``128 + signum``."""

    def __init__(self, signum: int, why: str) -> None:
        super().__init__(why)
        self.signum = signum


@contextlib.contextmanager
def stops_deferred(why: str) -> Iterator[None]:
    """SIGTERM and SIGINT do not interrupt the block (in the main thread): each one says in a line that the command
    is ``why`` (SIGKILL still ends it). For the cleanup after a stop, which a second Ctrl-C would otherwise cut
    short, leaving the run it ends ``RUNNING``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):
            os.write(2, f"[pretrain] {signal.Signals(signum).name}: {why}\n".encode())

    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def request_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / STOP_REQUEST


def read_request(run_dir: Path | str) -> dict[str, Any] | None:
    """The stop request in ``run_dir``, or None when there is none."""
    try:
        raw = json.loads(request_path(run_dir).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def write_request(run_dir: Path | str, signame: str) -> None:
    """Ask the run's workers to stop (atomically: a worker reads a whole request or none)."""
    path = request_path(run_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"signal": signame, "at": time.time(), "pid": os.getpid()}))
    os.replace(tmp, path)


def clear_request(run_dir: Path | str) -> None:
    """Remove a stop request (this driver's, or one left by a driver killed before its run ended)."""
    request_path(run_dir).unlink(missing_ok=True)
