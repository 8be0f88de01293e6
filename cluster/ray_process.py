"""The embedded Ray's processes: started with the signals a run's stop needs handled (SIGINT ignored and SIGTERM
blocked in them, the driver's SIGTERM handler kept), and ended at once (SIGKILL of their process trees, this driver
disconnected first) rather than by Ray's graceful shutdown, which waits on each process.

A terminal's Ctrl-C, ``timeout``, ``kill -- -PGID`` and schedulers signal a whole process group, Ray's processes in
it: they keep running while the driver stops the run with its checkpoint (``pretrain/driver/signals.py``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while the block runs (in the main thread; elsewhere no signal handler can change)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread while the block runs, so the processes it starts inherit it blocked (Ray blocks
    SIGINT in its processes the same way): the raylet and GCS take a SIGTERM for a shutdown, and a signal to the
    whole process group would end them under the stopping run. They end with this process
    (:func:`end_ray_with_process`: SIGKILL). A SIGTERM that comes meanwhile is delivered when the block ends."""
    # (Linux only: elsewhere Ray is shut down gracefully, which would wait on each process that cannot take it)
    if threading.current_thread() is not threading.main_thread() or not sys.platform.startswith("linux"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """A SIGTERM handler of ours (a run's stop handling: :mod:`pretrain.driver.signals`) is back after the block:
    ``ray.init`` sets its own for the driver (the process exits with status 15) at its start and keeps it. A SIGTERM
    that Ray's handler took meanwhile is then a stop at once (:class:`~pretrain.driver.signals.StopNow`), and the
    processes the interrupted start had made are killed (:func:`end_ray_with_process`: the command ends). Without a
    handler of ours (the default action), Ray's stays."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    try:
        yield
    except SystemExit as e:
        if e.code != signal.SIGTERM:
            raise
        from pretrain.train.stop_request import StopNow

        with contextlib.suppress(Exception):  # what the interrupted start made (disconnected first): the command ends
            end_ray_with_process(True)
        raise StopNow(signal.SIGTERM, "SIGTERM: stopped at once") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_ray(started: bool) -> None:
    """Shut down the Ray this process started (a no-op otherwise). The embedded Ray's processes block SIGTERM
    (:func:`sigterm_blocked`), with which Ray's graceful shutdown asks each of them to end before it waits a second
    and kills it: on Linux this driver is disconnected and those processes (with the agents and workers under them)
    are killed at once instead; other processes under this one are left as they are. Elsewhere ``ray.shutdown()``."""
    if not started:
        return
    import ray

    if not sys.platform.startswith("linux"):
        ray.shutdown()
        return
    from ray._private import worker as ray_worker  # private: the one handle on the node ray.init started

    node = ray_worker._global_node
    procs: list[Any] = [info.process for infos in node.all_processes.values() for info in infos] if node else []
    _disconnect()
    _kill_trees([p.pid for p in procs])
    for proc in procs:  # reaped: a long-lived process (a study, a benchmark) keeps no zombies
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
    if node is not None and node.is_head():  # objects Ray Data spilled to disk (ray.shutdown removes them too)
        with contextlib.suppress(Exception):
            node.destroy_external_storage()


def _disconnect() -> None:
    """This process's Ray driver disconnected, the servers it started left running (to be killed by the caller), and
    Ray's graceful shutdown at the interpreter's exit unregistered."""
    import atexit

    import ray
    from ray._private import worker as ray_worker

    atexit.unregister(ray.shutdown)  # the graceful shutdown Ray registered for the interpreter's exit
    ray_worker._global_node = None  # so ray.shutdown() only disconnects this driver; the servers are ours
    ray.shutdown()


def end_ray_with_process(started: bool) -> None:
    """The command's last act after a finished run: the embedded Ray this process started (``started``) is left
    to end with the process instead of shut down gracefully. Ray starts its local processes to die with their
    parent (fate sharing: ``prctl(PR_SET_PDEATHSIG)`` on Linux, so the CLI's exit ends them, and their workers
    with them); its graceful shutdown stops them process by process, waiting on each, after every command, which
    adds to the command's wall time. Not on Linux, or when this process did not start Ray: :func:`stop_ray`.

    Fate sharing reaches only Ray's direct children (GCS, raylet, monitors): the raylet's agents (dashboard and
    runtime-env agents), left without a raylet that ended by SIGKILL, take it for a crash and keep trying to report
    it to the dead GCS for about a minute before exiting, using CPU meanwhile. So every process under this one is
    killed here as fate sharing would, without waiting for any of them.

    This process's own Ray driver is disconnected first, as :func:`ray.shutdown` does before it stops the servers:
    the driver's core worker, left connected to a raylet that dies under it, may end the whole process with exit
    status 1 and nothing on stderr (Ray logs the reason to its own session files), before the summary is out."""
    if started and sys.platform.startswith("linux"):
        _disconnect()
        _kill_descendants()
        return
    stop_ray(started)


def _kill_descendants() -> None:
    """SIGKILL every process under this one (the embedded Ray's), children before their parents' own ends."""
    import psutil  # a dependency of ray

    _kill_trees([psutil.Process().pid], itself=False)


def _kill_trees(pids: list[int], itself: bool = True) -> None:
    """SIGKILL the processes under each of ``pids`` (children first) and, with ``itself``, that process."""
    import psutil  # a dependency of ray

    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [*reversed(root.children(recursive=True)), *([root] if itself else [])]
        except psutil.Error:  # already gone
            continue
        for proc in procs:
            try:
                proc.kill()
            except psutil.Error:
                pass
