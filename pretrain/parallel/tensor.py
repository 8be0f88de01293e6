"""Tensor parallelism (DeepSpeed AutoTP): the AutoTP section of the DeepSpeed config (DeepSpeed splits the layers
when the engine is built), marking the split parameters, and the whole weights (and optimizer moments) of a
tensor-parallel module, gathered from and split back into its shards.

Rank layout (``pretrain/parallel/dims.py``): ``rank = (d * N + s) * M + t``; tensor-parallel groups are the ``M``
consecutive ranks of one ``(d, s)`` (DeepSpeed's AutoTP mesh), created by DeepSpeed and reached through
``pretrain.ds_adapter``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from pretrain import ds_adapter
from pretrain.parallel import collectives
from pretrain.parallel.dims import ParallelDims

StateDict = dict[str, torch.Tensor]


def autotp_section(dims: ParallelDims) -> dict:
    """The ``tensor_parallel`` section of the DeepSpeed config: AutoTP with a partition config for our layer names
    (q/k/v, gate/up column-parallel; o/down row-parallel; everything else whole). The per-head ``q_norm``/``k_norm``
    stay whole but see only a worker's heads: their gradients are summed over the tensor-parallel group."""
    return {
        "autotp_size": dims.tensor,
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


def deepspeed_section(dims: ParallelDims) -> dict:
    """This parallelism's part of the DeepSpeed config: ``{"tensor_parallel": ...}`` under tensor parallelism."""
    return {"tensor_parallel": autotp_section(dims)} if dims.tensor > 1 else {}


def prepare_tensor_parallel(dims: ParallelDims) -> None:
    """Before an engine of tensor-parallel degree ``dims.tensor`` is built: drop DeepSpeed's groups of another size
    (processes that built such an engine before, e.g. a test's), so DeepSpeed creates those of this layout."""
    size = dims.tensor
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
    gathered whole over the tensor-parallel group (collective over it, on its device: host tensors come back on the
    host; no-op without tensor parallelism)."""
    splits = _splits(model)
    if not splits:
        return state
    group = ds_adapter.tensor_parallel_group()
    out = dict(state)
    for name, (dim, sizes, _) in splits.items():
        if name not in out:
            continue
        local = out[name]
        shapes = [[size if d == dim else n for d, n in enumerate(local.shape)] for size in sizes]
        out[name] = torch.cat(collectives.all_gather(local, shapes, group), dim=dim)
    return out


def local_shards(model: nn.Module, state: StateDict) -> StateDict:
    """Whole tensors by parameter name -> this rank's AutoTP shards of the split ones (the inverse of
    :func:`gather_shards`)."""
    out = dict(state)
    for name, (dim, sizes, index) in _splits(model).items():
        if name in out:
            out[name] = out[name].split(sizes, dim=dim)[index].contiguous()
    return out
