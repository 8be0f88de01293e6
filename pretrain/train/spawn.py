"""``run_distributed(fn, world_size, *args)``: run ``fn(rank, world_size, *args)`` in ``world_size`` fresh local
processes joined by a real gloo process group; returns each rank's return value (rank order).

Not how training runs (jobs run through Ray or torchrun, see ``dist.py``): the ``bench`` modes that measure several
ranks on one machine (``benchmarks/moe.py``, ``benchmarks/parallel.py``) and the multi-rank tests
(``tests/harness.py``) start their ranks with it. It lives beside ``dist.py`` because both the installed ``bench``
command and the tests need it, and neither ``benchmarks`` nor ``pretrain`` may import ``tests``.

The processes meet through a file store in a fresh temporary directory, not a TCP port picked in advance: a port
that was free when picked can be taken before rank 0 listens on it (EADDRINUSE), a race a busy machine loses."""

from __future__ import annotations

import os
import shutil
import tempfile
import traceback

import torch.multiprocessing as mp

from pretrain.train.dist import free_port


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world_size`` local processes (as torchrun sets it)."""
    return dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def _entry(rank, world_size, port, store_path, fn, args, queue):
    os.environ.update(rank_env(rank, world_size, port))
    try:
        import torch.distributed as dist

        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # report, never hang the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()  # only exported as MASTER_PORT for code that reads it; the rendezvous is the file store
    rdzv = tempfile.mkdtemp(prefix="pretrain-rdzv-")
    store = os.path.join(rdzv, "store")
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, store, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        shutil.rmtree(rdzv, ignore_errors=True)
    return [results[r] for r in range(world_size)]
