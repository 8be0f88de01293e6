"""Single-process tests. Under pytest-xdist (``./launch.sh test`` runs them on every core) each worker's torch gets
its share of the cores: torch's default, every core in every worker, oversubscribes a small machine and makes each
test slower."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has ``n`` visible CUDA devices (0: CUDA is not available)."""
    import torch

    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return have
