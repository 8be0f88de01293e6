"""A study's runs side by side (``bench --growth --jobs N``, ``bench --early-exit --jobs 2``): each run in its own
spawned process, pinned to its share of this machine's CPUs, at most N at a time.

A study's runs do not depend on each other, and a small model uses a CPU core better alone than two cores together
(docs/benchmarks.md, the growth study's ``--jobs``), so running them side by side shortens a study. The worker sizes
its threads from its CPU affinity (``pretrain.train.worker``), so a run's config is the same whichever share it had;
whether the losses are too is checked by the growth study's test (tests/integration/bench/test_studies.py).

Each process prints through a prefix naming its run (``[scratch seed 0] [train] step ...``). The first failure
stops the others and raises, naming the run. Ctrl-C reaches every process; SIGTERM to this process stops them too
(it raises here); and a process whose parent dies (``kill -9``, a test's timeout) is sent SIGTERM by the kernel, so
no run goes on training for nobody."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import wait
from typing import Any

Task = tuple[str, Callable[..., Any], tuple]
"""(name, function, arguments): ``function(*arguments)`` runs in a process of its own; both must pickle."""

STOP_WAIT_S = 30
"""How long a process may take to end after SIGTERM (or after sending its result) before it is killed."""


def cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity; count them
        return list(range(os.cpu_count() or 1))


def jobs_of(text: str, gpu: bool) -> int:
    """``bench --jobs``: a count, or ``auto`` (one per CPU this process may use without a GPU, else 1)."""
    if text == "auto":
        return 1 if gpu else len(cpus())
    if not text.isdigit() or not 1 <= int(text) <= len(cpus()):
        raise SystemExit(f"bench --jobs: {text!r} is not auto or a count from 1 to the {len(cpus())} CPUs here")
    return int(text)


def core_sets(jobs: int, available: list[int]) -> list[list[int]]:
    """``jobs`` disjoint, contiguous sets of the CPUs ``available``, as equal as they divide (the first sets take
    the remainder); ``jobs`` above the CPUs is refused."""
    if not 1 <= jobs <= len(available):
        raise ValueError(f"--jobs {jobs}: between 1 and the {len(available)} CPUs this process may use")
    size, extra = divmod(len(available), jobs)
    sets, at = [], 0
    for i in range(jobs):
        n = size + (i < extra)
        sets.append(available[at : at + n])
        at += n
    return sets


class _Prefixed:
    """A text stream that starts every line with ``prefix``."""

    def __init__(self, stream, prefix: str) -> None:
        self.stream, self.prefix, self.at_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for line in text.splitlines(keepends=True):
            if self.at_start:
                out.append(self.prefix)
            out.append(line)
            self.at_start = line.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _out_fd() -> int:
    """The descriptor (1 or 2) this process's ``sys.stdout`` writes to (2 under ``redirect_stdout(sys.stderr)``)."""
    try:
        return 2 if sys.stdout.fileno() == 2 else 1
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return 1


def _die_with_parent(parent: int) -> None:
    """SIGTERM to this process when its parent ends (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it ended before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _child(conn, parent: int, cores: list[int], out_fd: int, name: str, fn: Callable[..., Any], args: tuple) -> None:
    _die_with_parent(parent)
    if out_fd != 1:  # where the parent prints, for C-level writes too
        os.dup2(out_fd, 1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    sys.stdout = _Prefixed(sys.stdout, f"[{name}] ")
    sys.stderr = _Prefixed(sys.stderr, f"[{name}] ")
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # the parent reports it, naming the run
        conn.send(("error", traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        conn.close()


def run_side_by_side(
    tasks: Iterable[Task], jobs: int, on_done: Callable[[int, Any], None] = lambda i, result: None
) -> list[Any]:
    """Every task's result, in task order, running at most ``jobs`` at a time, each in a spawned process pinned to
    one of :func:`core_sets`. ``tasks`` is read lazily: the next task is taken when a process ends, so a task
    prepared by the iterator starts when it is taken. ``on_done(index, result)`` runs in this process as each ends.
    A process prints where this one's ``sys.stdout`` does (its stdout or stderr). A task that raises, or whose
    process dies, stops the others (once every process that ended with it is read) and raises ``RuntimeError`` with
    its name and traceback."""
    ctx = mp.get_context("spawn")
    free = core_sets(jobs, cpus())
    out_fd = _out_fd()
    todo: Iterator[Task] = iter(tasks)
    running: dict[Any, tuple[int, str, Any, list[int]]] = {}  # pipe end -> index, name, process, cores
    results: dict[int, Any] = {}
    with _sigterm_raises():
        try:
            _loop(ctx, free, out_fd, todo, running, results, on_done)
        finally:
            _stop([proc for _, _, proc, _ in running.values()])
    return [results[i] for i in sorted(results)]


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM to this process raises ``SystemExit(143)`` meanwhile (in the main thread), so the processes are
    stopped and the caller's cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _loop(ctx, free, out_fd, todo, running, results, on_done) -> None:
    """Start tasks while CPUs are free, read each process's result as it ends, until every task has ended."""
    index = 0
    exhausted = False
    parent = os.getpid()
    while running or not exhausted:
        while free and not exhausted:
            task = next(todo, None)
            if task is None:
                exhausted = True
                break
            name, fn, args = task
            cores = free.pop(0)
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(child_end, parent, cores, out_fd, name, fn, args), name=name)
            proc.start()
            child_end.close()
            running[parent_end] = (index, name, proc, cores)
            index += 1
        if not running:
            break
        ready = wait(list(running))
        failed = None
        for conn in [c for c in running if c in ready]:
            i, name, proc, cores = running.pop(conn)
            try:
                status, value = conn.recv()
            except EOFError:
                proc.join(STOP_WAIT_S)
                status, value = "error", f"its process ended with exit code {proc.exitcode} and no result"
            conn.close()
            proc.join(STOP_WAIT_S)  # it has sent its result: what is left is its interpreter's teardown
            _stop([proc])
            if status != "ok":
                failed = failed or f"{name} failed:\n{value}"
                continue
            results[i] = value
            free.append(cores)
            on_done(i, value)
        if failed:
            raise RuntimeError(failed)


def _stop(procs: list) -> None:
    """End the processes still running: SIGTERM, then (after :data:`STOP_WAIT_S`) kill."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(STOP_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
