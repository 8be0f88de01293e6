"""The processes of a local Ray head (``cluster up``): finding exactly its own (:func:`head_processes`) and ending
them (:func:`terminate`), never anything else on the machine."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def restart_mark() -> str | None:
    """This boot of the machine and this start of the container (PID namespace) this runs in, unaffected by clock
    changes: the kernel's boot id and PID 1's start in clock ticks since boot (``/proc``); None where there is none."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path("/proc/1/stat").read_text()
        start = stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name (which may hold spaces)
    except (OSError, IndexError):
        return None
    return f"{boot}:{start}"


def restarted_since(state: dict[str, Any]) -> bool:
    """The machine or container restarted since the head of ``state`` started: none of its processes is alive, and
    its session id and pids may now be other processes'. (A state recorded without the mark, or a machine without
    one: not known.)"""
    mark, now = state.get("restart_mark"), restart_mark()
    return isinstance(mark, str) and now is not None and mark != now


def head_processes(state: dict[str, Any]) -> list:
    """Every live process of the recorded head: a Ray binary, the head's Python or a job's driver (created after the
    ``ray start`` leader) in the leader's session or running in the head's temp dir (a job's driver, whose
    supervisor has gone), and their descendants (job drivers start their own sessions). Nothing else on the
    machine: a shell or a ``tail -f`` in the head's log directory is not the head's."""
    import psutil

    sid = int(state.get("sid", 0))
    started = float(state.get("started_at", 0)) - 2.0
    temp_dir = str(state.get("temp_dir", "")).rstrip("/")
    found: dict[int, Any] = {}
    if sid <= 1 or not temp_dir or restarted_since(state):
        return []
    ours = _ray_executables(state)
    for p in psutil.process_iter(["pid", "create_time"]):
        try:
            if p.pid == os.getpid() or p.info["create_time"] < started:
                continue
            if session_of(p.pid) != sid and not works_under(p, temp_dir):
                continue
            # ... and a Ray binary or the head's Python: a recycled session id or a working directory is not enough
            exe = os.path.realpath(p.exe())
            if any(exe == o or exe.startswith(o + os.sep) for o in ours) or _runs_a_job(p.cmdline()):
                found[p.pid] = p
        except (psutil.Error, OSError):
            continue
    for p in list(found.values()):
        try:
            for c in p.children(recursive=True):
                if c.pid != os.getpid():
                    found.setdefault(c.pid, c)
        except psutil.Error:
            continue
    return list(found.values())


def works_under(proc, directory: str, max_depth: int = 64) -> bool:
    """Whether ``proc``'s working directory is ``directory`` or lies below it, compared as directories (device and
    inode), not as path strings: a path through a symbolic link, a bind mount or another mount namespace names the
    same directory differently. Walks up from ``/proc/PID/cwd`` where there is one; elsewhere compares real paths."""
    try:
        target = os.stat(directory)
    except OSError:
        return False
    here = f"/proc/{proc.pid}/cwd"
    if os.path.exists(here):
        previous = None
        for _ in range(max_depth):
            st = os.stat(here)  # PermissionError (another user's process) is the caller's to skip
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                return True
            if previous == (st.st_dev, st.st_ino):  # the root: its parent is itself
                return False
            previous = (st.st_dev, st.st_ino)
            here += "/.."
        return False
    cwd, real = os.path.realpath(proc.cwd()), os.path.realpath(directory)
    return cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep)


def _runs_a_job(cmdline: list[str]) -> bool:
    """A job's driver whatever Python runs it (``submit --python OTHER``): ``PYTHON -m pretrain ...``."""
    return any(a == "-m" and b == "pretrain" for a, b in zip(cmdline, cmdline[1:]))


def _ray_executables(state: dict[str, Any]) -> list[str]:
    """Executables a process of this head runs: the Ray package's binaries, the head's Python."""
    import importlib.util

    out = [os.path.realpath(sys.executable)]
    if state.get("python"):
        out.append(os.path.realpath(state["python"]))
    spec = importlib.util.find_spec("ray")
    if spec and spec.submodule_search_locations:
        out += [os.path.realpath(d) for d in spec.submodule_search_locations]
    return out


def terminate(procs: list, grace_s: float = 10.0) -> int:
    import psutil

    grace_s = max(0.0, grace_s)

    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(procs)
