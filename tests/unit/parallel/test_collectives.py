"""Collectives on host tensors (``pretrain/parallel/collectives.py``): the full-state gathers run on the group's
device and hand back host tensors. The gathers themselves run on real gloo ranks in
tests/integration/parallel/test_model_parallel.py and test_moe.py; NCCL's device is not on this machine."""

from __future__ import annotations

import pytest
import torch

from pretrain.parallel import collectives


def test_the_device_follows_the_backend(monkeypatch):
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "gloo")
    assert collectives.collective_device() == torch.device("cpu")
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.collective_device() == torch.device("cuda", 3)  # NCCL: the rank's own GPU


@pytest.mark.parametrize("sizes", [[2, 2], [3, 1, 2]])
def test_all_gather_runs_on_the_group_device_and_returns_on_the_callers(monkeypatch, sizes):
    """Uneven shards (tensor parallelism splits unevenly) in rank order; what is sent is contiguous and on the
    collective's device; every part comes back on the caller's device."""
    seen = []

    def fake_all_gather(parts, send, group=None):
        seen.append((send.device, send.is_contiguous(), [p.device for p in parts]))
        for r, p in enumerate(parts):
            p.fill_(r)

    monkeypatch.setattr(collectives, "collective_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(collectives.dist, "all_gather", fake_all_gather)
    local = torch.zeros(4, sizes[0]).t()  # (sizes[0], 4), not contiguous
    parts = collectives.all_gather(local, [(s, 4) for s in sizes])
    assert [tuple(p.shape) for p in parts] == [(s, 4) for s in sizes]
    assert [p.unique().tolist() for p in parts] == [[r] for r in range(len(sizes))]
    assert seen == [(torch.device("cpu"), True, [torch.device("cpu")] * len(sizes))]
    assert all(p.device == local.device for p in parts)
