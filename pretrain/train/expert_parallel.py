"""Expert parallelism, applied to a built model from outside (the model code stays single-device).

:func:`apply_expert_parallel` turns every MoE layer built with ``ep_size > 1`` into a DeepSpeed MoE layer (the
instance's class becomes a subclass that is also ``deepspeed.moe.layer.MoE``, the way FSDP2's ``fully_shard``
swaps classes) and tags its expert parameters as DeepSpeed does (``allreduce = False``, ``group_name``). The
DeepSpeed engine then

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

from pretrain.model.moe import MoEFeedForward, moe_layers


def group_name(ep_size: int) -> str:
    """DeepSpeed's key of the expert-parallel groups of one size."""
    return f"ep_size_{ep_size}"


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


def _set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
    """Called by the DeepSpeed engine: create (once) and adopt the expert-parallel process groups."""
    from deepspeed.utils import groups

    name = group_name(self.ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(
            self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
    rank = groups._get_expert_parallel_rank(name)
    if rank != self.ep_rank:
        raise RuntimeError(f"expert layout mismatch: layer built for EP rank {self.ep_rank}, DeepSpeed says {rank}")
    self.exchange = AllToAllExchange(groups._get_expert_parallel_group(name))


@lru_cache(maxsize=1)
def _deepspeed_moe_class() -> type:
    """``MoEFeedForward`` that is also a ``deepspeed.moe.layer.MoE`` (what the engine's MoE handling keys on)."""
    from deepspeed.moe.layer import MoE

    return type("ExpertParallelMoE", (MoEFeedForward, MoE),
                {"__module__": __name__, "set_deepspeed_parallelism": _set_deepspeed_parallelism})


def apply_expert_parallel(model: nn.Module) -> int:
    """Make the model's expert-parallel MoE layers DeepSpeed MoE layers (see module doc); before
    ``deepspeed.initialize``. Returns how many layers it converted (0 for dense models and ``ep_size`` 1)."""
    converted = 0
    for _, layer in moe_layers(model):
        if layer.ep_size == 1:
            continue  # experts are ordinary data-parallel weights
        if not isinstance(layer, _deepspeed_moe_class()):
            layer.__class__ = _deepspeed_moe_class()
            layer.expert_group_name = group_name(layer.ep_size)  # read by DeepSpeed's checkpoint code
        for p in layer.experts.parameters():
            p.allreduce = False
            p.group_name = layer.expert_group_name
        converted += 1
    return converted


def exchanges(model: nn.Module) -> list[AllToAllExchange]:
    """The installed all-to-all exchanges (for timing)."""
    return [layer.exchange for _, layer in moe_layers(model) if isinstance(layer.exchange, AllToAllExchange)]
