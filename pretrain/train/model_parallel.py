"""Sequence parallelism (DeepSpeed Ulysses) and tensor parallelism (DeepSpeed AutoTP) on the training side: the
process groups, applying them to a model, the AutoTP section of the DeepSpeed config, and the whole weights (and
optimizer moments) of a tensor-parallel module, gathered from and split back into its shards.

Rank layout (``pretrain/config/parallel.py``): ``rank = (d * N + s) * M + t``. Tensor-parallel groups are ``M``
consecutive ranks (DeepSpeed's AutoTP mesh); a sequence-parallel group is the ``N`` ranks of one ``(d, t)``, ``M``
apart. DeepSpeed is not told about sequence parallelism: its data-parallel group spans ``N x D`` ranks (ZeRO
partitions over all of them), and the loss scaling of ``pretrain/train/sequence_parallel.py`` makes its gradient
average the average over the ``D`` data-parallel ranks.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn

from pretrain import ds_adapter
from pretrain.config import RunConfig
from pretrain.model import Transformer
from pretrain.model.layers import Attention
from pretrain.train.sequence_parallel import SequenceShards, ulysses_attention

StateDict = dict[str, torch.Tensor]

# Process groups are created collectively, once per layout and default group (a growth rebuild reuses them).
_SEQUENCE_GROUPS: dict[tuple[int, int, int, int], tuple[dist.ProcessGroup, int]] = {}


def sequence_group(world: int, n: int, m: int) -> tuple[dist.ProcessGroup, int]:
    """(this rank's sequence-parallel group, its index in it). Collective the first time for a layout: every rank
    creates every group, in the same order."""
    key = (id(dist.group.WORLD), world, n, m)
    if key not in _SEQUENCE_GROUPS:
        rank, mine = dist.get_rank(), None
        for first in range(world):
            if (first // m) % n:  # not the first of its group
                continue
            ranks = [first + s * m for s in range(n)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = (group, ranks.index(rank))
        assert mine is not None
        _SEQUENCE_GROUPS[key] = mine
    return _SEQUENCE_GROUPS[key]


def apply_sequence_parallel(model: Transformer, cfg: RunConfig) -> None:
    """Make ``model`` (a Transformer) keep its slice of every sequence and attend through DeepSpeed's Ulysses
    all-to-all, for ``cluster.sequence_parallel`` > 1 (collective); nothing otherwise."""
    n, m = cfg.cluster.sequence_parallel, cfg.cluster.tensor_parallel
    if n == 1:
        return
    group, index = sequence_group(dist.get_world_size(), n, m)
    model.sequence_shards = SequenceShards(group, index, n)
    for block in model.blocks:
        attn = cast(Attention, block.attn)
        attn.use_ulysses(ulysses_attention(attn, group))


def autotp_section(cfg: RunConfig) -> dict:
    """The ``tensor_parallel`` section of the DeepSpeed config: AutoTP with a partition config for our layer names
    (q/k/v, gate/up column-parallel; o/down row-parallel; everything else whole). The per-head ``q_norm``/``k_norm``
    stay whole but see only a worker's heads: their gradients are summed over the tensor-parallel group."""
    return {
        "autotp_size": cfg.cluster.tensor_parallel,
        "partition_config": {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [r".*\.attn\.o_proj\.weight$", r".*\.ffn\.down_proj\.weight$"], "partition_type": "row"},
                {
                    "patterns": [r".*\.attn\.[qkv]_proj\.weight$", r".*\.ffn\.(gate|up)_proj\.weight$"],
                    "partition_type": "column",
                },
                {
                    "patterns": [r".*\.attn\.[qk]_norm\.(weight|bias)$"],
                    "partition_type": "skip",
                    "grad_allreduce": True,
                },
            ],
        },
    }


def prepare_tensor_parallel(size: int) -> None:
    """Before an engine of tensor-parallel ``size`` is built: drop DeepSpeed's groups of another size (processes that
    built such an engine before, e.g. a test's), so DeepSpeed creates those of this layout."""
    if ds_adapter.tensor_parallel_size() != size and (size > 1 or ds_adapter.tensor_parallel_size() > 1):
        ds_adapter.reset_parallel_groups()


def _splits(model: nn.Module) -> dict[str, tuple[int, list[int], int]]:
    """{parameter name: (split dim, split sizes, this rank's index)} of the parameters AutoTP split."""
    out = {}
    for name, module in model.named_modules():
        split = ds_adapter.tensor_parallel_split(module)
        if split is None:
            continue
        weight_dim, bias_dim, sizes, index = split
        prefix = f"{name}." if name else ""
        out[f"{prefix}weight"] = (weight_dim, sizes, index)
        if bias_dim is not None and getattr(module, "bias", None) is not None:
            out[f"{prefix}bias"] = (bias_dim, sizes, index)
    return out


def mark_shards(model: nn.Module) -> None:
    """Mark the parameters AutoTP split (``tensor_parallel_shard``), so cross-rank sums of per-parameter numbers
    (gradient and parameter norms, ``pretrain/train/health.py``) count the weights left whole once."""
    params = dict(model.named_parameters())
    for name in _splits(model):
        if name in params:
            params[name].tensor_parallel_shard = True  # type: ignore[attr-defined]


def gather_shards(model: nn.Module, state: StateDict) -> StateDict:
    """``state`` (by parameter name: this rank's AutoTP shards, e.g. weights or moments) with every split tensor
    gathered whole over the tensor-parallel group (collective over it; no-op without tensor parallelism)."""
    splits = _splits(model)
    if not splits:
        return state
    group = ds_adapter.tensor_parallel_group()
    out = dict(state)
    for name, (dim, sizes, _) in splits.items():
        if name not in out:
            continue
        local = out[name].contiguous()
        shape = list(local.shape)
        parts = []
        for size in sizes:
            shape[dim] = size
            parts.append(torch.empty(shape, dtype=local.dtype, device=local.device))
        dist.all_gather(parts, local, group=group)
        out[name] = torch.cat(parts, dim=dim)
    return out


def local_shards(model: nn.Module, state: StateDict) -> StateDict:
    """Whole tensors by parameter name -> this rank's AutoTP shards of the split ones (the inverse of
    :func:`gather_shards`)."""
    out = dict(state)
    for name, (dim, sizes, index) in _splits(model).items():
        if name in out:
            out[name] = out[name].split(sizes, dim=dim)[index].contiguous()
    return out
