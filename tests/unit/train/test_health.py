"""The health probe's output-logit statistics (``pretrain/train/health.py``), taken chunk by chunk so that its fp32
copies stay small beside a large vocabulary's logits."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pretrain.parallel.dims import ParallelDims
from pretrain.train import health


def test_logit_statistics_in_chunks_equal_the_whole_tensor(monkeypatch):
    monkeypatch.setattr(health, "LOGIT_CHUNK", 3 * 7)  # 3 rows of 7 at a time: 4 chunks, the last one short
    logits = (torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    probe = health.HealthProbe(SimpleNamespace(module=torch.nn.Linear(2, 2)), ParallelDims())
    probe.detach(SimpleNamespace(logits=logits))
    x = logits.float()
    torch.testing.assert_close(probe.sums["logit_ms"], x.pow(2).mean().item(), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        probe.sums["logsumexp_sq"], torch.logsumexp(x, -1).pow(2).mean().item(), rtol=1e-6, atol=0
    )


def test_each_value_is_counted_by_the_ranks_the_layout_names(monkeypatch):
    """Which ranks count a weight comes from the parallel layout: replicated dense weights once each, dealt out
    over the ranks by size (the update ratio snapshots what a rank counts: not every weight on rank 0), a
    tensor-parallel shard on the first tensor-parallel group (each rank its own shard), an expert weight on the first
    rank of its expert-data-parallel group; ZeRO partitions of whole weights once per tensor-parallel group."""
    dense, shard, expert = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    shard.tensor_parallel_shard = True  # type: ignore[attr-defined]
    expert.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's expert tag
    views = [(dense, dense), (shard, shard), (expert, expert)]
    names = {id(dense): "dense", id(shard): "shard", id(expert): "expert"}
    sizes = [800, 100, 100, 300, 300, 200, 200, 100]  # an embedding, then smaller weights
    many = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    names |= {id(p): f"w{i}" for i, p in enumerate(many)}

    def counters(dims: ParallelDims, select) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {n: [] for n in names.values()}
        for rank in range(dims.world):
            monkeypatch.setattr(health, "_rank", lambda rank=rank: rank)
            for p, _ in select(views, dims):
                out[names[id(p)]].append(rank)
        return out

    replicated = counters(ParallelDims(world=4, tensor=2, expert=2), health._owned)
    assert {k: replicated[k] for k in ("dense", "shard", "expert")} == {"dense": [0], "shard": [0, 1], "expert": [0, 1]}
    views += [(p, p) for p in many]
    dealt = counters(ParallelDims(world=4), health._owned)
    assert all(len(dealt[f"w{i}"]) == 1 for i in range(len(many))), dealt  # each counted once
    per_rank = [sum(n for i, n in enumerate(sizes) if dealt[f"w{i}"] == [r]) for r in range(4)]
    assert max(per_rank) == 800 and sorted(per_rank) == [400, 400, 500, 800], per_rank  # at most the largest weight
    assert counters(ParallelDims(world=4, expert=4), health._owned)["expert"] == [0, 1, 2, 3]
    partitions = counters(ParallelDims(world=4, tensor=2), health._once_per_tensor_group)
    assert {k: partitions[k] for k in ("dense", "shard", "expert")} == {
        "dense": [0, 2],
        "shard": [0, 1, 2, 3],
        "expert": [0, 2],
    }
