"""Tests use the benchmarks' real-process launcher (``benchmarks/procs.py``)."""

from benchmarks.procs import run_distributed

__all__ = ["run_distributed", "train_jobs"]


def train_jobs(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    """In each process of ``run_distributed``: run the training function on each job (``Job`` as dict), in order."""
    from pretrain.train.worker import train_loop

    return [train_loop(job) for job in jobs]
