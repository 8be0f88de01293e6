"""What ``cluster up`` records of its local Ray head, and what keeps two commands from stepping on it: the state
directory (``.cache/ray-head``; ``PRETRAIN_RAY_HEAD_DIR`` overrides it) with ``state.json`` and the token file, the
lock that ``up`` and ``down`` hold, and the temp dir that a head owns. The commands are in :mod:`cluster.head`."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STATE_DIR_ENV = "PRETRAIN_RAY_HEAD_DIR"
TEMP_DIR_MARK = ".pretrain-ray-head"
"""A file in a head's temp dir naming the state directory of the head that made it."""


class ClusterError(Exception):
    """A user-facing cluster problem: one line, exit code 1."""


class ClusterUsageError(ClusterError):
    """A cluster command's bad argument (a job id, an address, a port, an ``--env`` name): one line, exit code 2."""


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV) or ROOT / ".cache" / "ray-head").resolve()


def token_path() -> Path:
    return state_dir() / "auth_token"


def read_state() -> dict[str, Any] | None:
    path = state_dir() / "state.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_state(state: dict[str, Any]) -> None:
    path = state_dir() / "state.json"
    tmp = path.with_name(f".state.json.{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)


def clear_state() -> None:
    (state_dir() / "state.json").unlink(missing_ok=True)


@contextlib.contextmanager
def locked(command: str) -> Iterator[None]:
    """Hold the state directory's lock while ``command`` (``up``, ``down``) changes the head: a second ``cluster
    up`` would otherwise take a head that is still starting for a dead one and end it."""
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterError(
                f"cluster {command}: another cluster up or down is running for {directory}; wait for it"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def new_token() -> Path:
    """The head's token file, with a new token for each head started (mode 600, 256 random bits; a token that an
    earlier head's clients hold opens nothing later); its content is never printed."""
    path = token_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.replace(tmp, path)
    return path


def read_token(path: Path | str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def claim_temp_dir(path: Path, given: bool = True, recorded: str = "") -> None:
    """Make ``path`` this head's temp dir, readable by its owner only: Ray's logs there record each job's runtime
    environment (``--env`` values included) and keep it after ``cluster down``; Ray makes its session directories
    inside world-writable, and a parent of mode 700 keeps other users out of all of them. ``down`` ends what works
    in it, so it must be a head's own: a directory of another owner, or one that holds anything but what a head of
    this state directory made (another Ray's temp dir, say), is refused. ``given``: the user's ``--temp-dir``
    (the default one is named after the state directory: its own by construction); ``recorded``: the temp dir the
    state of an earlier head here names (its own, marked or not)."""
    mark = path / TEMP_DIR_MARK
    if path.is_dir() and path.stat().st_uid != os.getuid():
        raise ClusterUsageError(f"--temp-dir {path}: owned by another user; pass a directory of yours")
    if given and path.is_dir() and str(path) != recorded:
        try:
            ours = not any(path.iterdir()) or mark.read_text().strip() == str(state_dir())
        except OSError:
            ours = False
        if not ours:
            raise ClusterUsageError(
                f"--temp-dir {path}: not empty, and not the temp dir of a head started here (another Ray's?); "
                f"pass a new or empty directory"
            )
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_uid != os.getuid():
        raise ClusterUsageError(f"--temp-dir {path}: owned by another user; pass a directory of yours")
    path.chmod(0o700)
    if not mark.is_file():
        mark.write_text(f"{state_dir()}\n")
