"""Expert parallelism (``parallel.expert``), applied to a built model from outside (the model code stays
single-device).

:func:`apply_expert_parallel` keeps on each worker the slice of experts of its expert-parallel rank
(:meth:`pretrain.parallel.dims.ParallelDims.expert_rank`; the model is built
with all of them, so every layout has the same expert weights) and turns every such MoE layer into a DeepSpeed MoE layer
(the instance's class becomes a subclass that is also ``deepspeed.moe.layer.MoE``, the way FSDP2's ``fully_shard`` swaps
classes) and tags its expert parameters as DeepSpeed does (both in :mod:`pretrain.ds_adapter`). The DeepSpeed engine
then

* calls ``set_deepspeed_parallelism``: the expert-parallel / expert-data-parallel groups are created (consecutive
  ranks form an EP group) and the layer gets an :class:`AllToAllExchange` on its EP group;
* reduces expert gradients over the expert-data-parallel group only and partitions their ZeRO-1/2 optimizer
  state there (with the optimizer groups of :func:`pretrain.train.engine.expert_param_groups`);
* writes one checkpoint file per expert (``layer_{l}_expert_{e}_mp_rank_00_model_states.pt``, global ids).
"""

from __future__ import annotations

import time
from functools import lru_cache

import torch
import torch.distributed as tdist
import torch.nn as nn

from pretrain import ds_adapter
from pretrain.model.moe import MoEFeedForward, moe_layers
from pretrain.parallel import collectives
from pretrain.parallel.dims import ParallelDims


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; the backward sends gradients back along the reverse splits
    (its time is added to ``timer.comm_seconds``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, timer) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.timer = (out_splits, in_splits), group, timer
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        tdist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        t0 = time.perf_counter()
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        tdist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        ctx.timer.comm_seconds += time.perf_counter() - t0
        return back, None, None, None, None


class AllToAllExchange:
    """The ``MoEFeedForward.exchange`` of one layer on one EP group: per-expert counts are exchanged, the tokens
    (sorted by global expert, hence by destination rank) sent to the ranks holding their experts, run there on
    the local experts in (expert, source) order, and sent back. ``comm_seconds`` accumulates the wall time of the
    all-to-alls, forward and backward, including the wait for the slowest peer."""

    def __init__(self, group) -> None:
        self.group = group
        self.comm_seconds = 0.0

    def __call__(self, layer: MoEFeedForward, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, local = layer.ep_size, layer.num_local_experts
        t0 = time.perf_counter()
        recv_counts = torch.empty_like(counts)
        tdist.all_to_all_single(recv_counts, counts, group=self.group)  # (ep * local,) source-major
        send = counts.view(ep, local).sum(1).tolist()
        table = recv_counts.view(ep, local)  # [source, local expert]
        recv = _AllToAll.apply(tokens, table.sum(1).tolist(), send, self.group, self)
        self.comm_seconds += time.perf_counter() - t0
        segments = recv.split(table.flatten().tolist())  # [(source, expert)] source-major
        by_expert = torch.cat([segments[s * local + j] for j in range(local) for s in range(ep)])
        out = layer.run_local(by_expert, table.sum(0))
        pieces = out.split(table.t().flatten().tolist())  # [(expert, source)] expert-major
        back = torch.cat([pieces[j * ep + s] for s in range(ep) for j in range(local)])
        t0 = time.perf_counter()
        result = _AllToAll.apply(back, send, table.sum(1).tolist(), self.group, self)
        self.comm_seconds += time.perf_counter() - t0
        return result


def _adopt_group(layer: MoEFeedForward, group) -> None:
    """The engine created the expert-parallel groups: exchange this layer's tokens on its EP group."""
    layer.exchange = AllToAllExchange(group)


@lru_cache(maxsize=1)
def _deepspeed_moe_class() -> type:
    """``MoEFeedForward`` that is also a ``deepspeed.moe.layer.MoE`` (what the engine's MoE handling keys on)."""
    return ds_adapter.deepspeed_moe_subclass(MoEFeedForward, _adopt_group, "ExpertParallelMoE", __name__)


def shard_experts(layer: MoEFeedForward, ep_size: int, ep_rank: int) -> None:
    """Keep experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` of a layer built with all E experts."""
    if layer.num_experts % ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"bad expert layout: {layer.num_experts} experts, ep_size {ep_size}, rank {ep_rank}")
    if layer.ep_size != 1:
        raise ValueError("experts are already sharded")
    local = layer.num_experts // ep_size
    first = ep_rank * local
    layer.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(list(layer.experts)[first : first + local])
    layer.ep_size, layer.ep_rank, layer.num_local_experts = ep_size, ep_rank, local


def apply_expert_parallel(model: nn.Module, dims: ParallelDims, rank: int) -> int:
    """Shard the experts of every MoE layer over ``dims.expert`` workers (this worker: global ``rank``) and make
    those layers DeepSpeed MoE layers (see module doc); before ``deepspeed.initialize``. Returns how many
    layers it converted (0 for dense models and ``parallel.expert`` 1)."""
    ep_size = dims.expert
    if ep_size == 1:
        return 0  # experts are ordinary data-parallel weights
    converted = 0
    for _, layer in moe_layers(model):
        shard_experts(layer, ep_size, dims.expert_rank(rank))
        layer.__class__ = _deepspeed_moe_class()
        ds_adapter.tag_expert_layer(layer, layer.experts, layer.ep_size)
        converted += 1
    return converted


def gather_experts(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (this worker's state dict, experts under local ids) with every expert of every sharded MoE
    layer under its global id, all-gathered over the expert-parallel group (collective on that group; host tensors
    gathered on the group's device, returned on the host)."""
    out = dict(state)
    for block, layer in moe_layers(model):
        if layer.ep_size == 1:
            continue
        group = ds_adapter.expert_parallel_group(layer.ep_size)
        prefix = f"blocks.{block}.ffn.deepspeed_moe.experts.deepspeed_experts."
        local = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        for key in list(out):
            if key.startswith(prefix):
                del out[key]
        for name in sorted(local):  # same order on every rank: "<local id>.<param>"
            e, rest = name.split(".", 1)
            parts = collectives.all_gather(local[name], [local[name].shape] * layer.ep_size, group)
            for r, t in enumerate(parts):
                out[f"{prefix}{r * layer.num_local_experts + int(e)}.{rest}"] = t
    return out


def global_param_names(model: nn.Module) -> dict[str, str]:
    """Parameter name -> its name in a full state dict, for the experts of every sharded MoE layer (local id ->
    global id: consecutive experts per EP rank, as :func:`shard_experts` keeps them); other names are unchanged."""
    out = {}
    for block, layer in moe_layers(model):
        if layer.ep_size == 1:
            continue
        prefix = f"blocks.{block}.ffn.deepspeed_moe.experts.deepspeed_experts."
        for name, _ in model.named_parameters():
            if name.startswith(prefix):
                e, rest = name[len(prefix) :].split(".", 1)
                out[name] = f"{prefix}{layer.ep_rank * layer.num_local_experts + int(e)}.{rest}"
    return out


def exchanges(model: nn.Module) -> list[AllToAllExchange]:
    """The installed all-to-all exchanges (for timing)."""
    return [layer.exchange for _, layer in moe_layers(model) if isinstance(layer.exchange, AllToAllExchange)]
