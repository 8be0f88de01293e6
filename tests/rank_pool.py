"""Real gloo processes for the multi-rank tests: ``run_distributed(fn, world_size, *args)`` runs on fresh processes
(``pretrain/train/spawn.py``), or with ``fresh=False`` on the session's processes of that world size, started once and
kept (``_RankPool``), which skips the seconds every fresh process spends on imports and its first DeepSpeed engine.
``tests.harness`` re-exports both functions."""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import tempfile
import traceback
from collections.abc import Callable

from pretrain.train import spawn

__all__ = ["close_pools", "run_distributed"]


def _serve(rank: int, world: int, port: int, store_path: str, tasks, results, parent: int) -> None:
    """A rank of a ``_RankPool``: join the gloo group once, then run each task it is sent, in the caller's working
    directory and environment, until told to stop (or its parent is gone)."""
    ours = spawn.rank_env(rank, world, port)
    os.environ.update(ours)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store_path, world))
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            break
        fn, args, env, cwd = task
        try:
            os.environ.clear()
            os.environ.update(env)
            os.environ.update(ours)
            os.chdir(cwd)
            result = fn(rank, world, *args)
            dist.barrier()
            results.put((rank, "ok", result))
        except BaseException:  # report, never hang the caller
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class _RankPool:
    """``world`` real processes joined by a real gloo group, kept for the session: each call sends every rank the
    same function, which runs as in ``pretrain.train.spawn.run_distributed``. A failed or timed-out call ends the
    pool (a rank may be stuck in a collective); the next call starts a new one."""

    def __init__(self, world: int) -> None:
        import torch.multiprocessing as mp

        from pretrain.train.dist import free_port

        ctx = mp.get_context("spawn")
        port = free_port()  # only exported as MASTER_PORT for code that reads it; the rendezvous is the file store
        self.world, self.rdzv = world, tempfile.mkdtemp(prefix="pretrain-pool-")
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(
                    r,
                    world,
                    port,
                    os.path.join(self.rdzv, "store"),
                    self.tasks[r],
                    self.results,
                    os.getpid(),
                ),
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, timeout: float) -> list:
        task = (fn, args, dict(os.environ), os.getcwd())
        for q in self.tasks:
            q.put(task)
        results: dict[int, object] = {}
        for _ in range(self.world):
            rank, status, payload = self.results.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
        return [results[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=30)
        shutil.rmtree(self.rdzv, ignore_errors=True)


_POOLS: dict[int, _RankPool] = {}


@atexit.register
def close_pools() -> None:
    """End the session's rank pools and remove their rendezvous directories. Called at the end of the pytest session
    (``tests/conftest.py``): pytest-xdist's workers exit without running ``atexit`` handlers."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_distributed(fn: Callable, world_size: int, *args, timeout: float = 600.0, fresh: bool = True) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` real processes joined by a real gloo group; each rank's return
    value (rank order). ``fresh``: processes started for this call alone (a resume whose checkpoint the session's
    processes wrote, output a test captures); else the session's processes of that world size, which run it in the
    caller's working directory and environment."""
    if fresh:
        return spawn.run_distributed(fn, world_size, *args, timeout=timeout)
    pool = _POOLS.get(world_size) or _POOLS.setdefault(world_size, _RankPool(world_size))
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(kill=True)
        raise
