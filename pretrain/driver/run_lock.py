"""One process trains a run at a time: the driver of ``train`` and ``resume`` holds an exclusive lock on its run
directory for as long as the run trains, and a ``resume`` of that run meanwhile is refused in one line naming the
process, before it records or deletes anything.

The lock is ``flock`` on ``RUN_DIR/.pretrain-run.lock``, which the kernel releases when the process ends however it
ends (a crash or ``kill -9`` leaves nothing to clean up; MLflow's RUNNING status would stay). The file itself stays,
holding the last holder's pid, host and start time for the message. Where the filesystem has no ``flock`` the run
trains without the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from pretrain.config import ConfigError
from pretrain.invocation import command

LOCK_FILE = ".pretrain-run.lock"


@contextlib.contextmanager
def hold_run(run_dir: Path, run_id: str) -> Iterator[None]:
    """Hold the run's lock while the context lasts; ConfigError (one line) when another process holds it."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a run directory this user cannot write (another's, a read-only mount)
        raise ConfigError(
            f"run {run_id}: cannot write its directory {run_dir} ({e.strerror or e}); resume where it is writable"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(
                    f"run {run_id} is training in another process ({_holder(fd)}): wait for it to end, or stop it "
                    f"(Ctrl-C in its terminal; {command()} stop JOB for a submitted job), then resume"
                ) from None
            # no flock on this filesystem (ENOLCK, EOPNOTSUPP, ...): train without the lock
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    try:
        who = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {who['pid']} on {who['host']}, since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid unknown"
