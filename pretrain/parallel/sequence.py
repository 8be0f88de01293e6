"""Sequence parallelism (DeepSpeed Ulysses), applied to the single-device model from outside
(:func:`apply_sequence_parallel` sets its ``Transformer.sequence_shards`` and each attention's Ulysses core): what
changes when the ``N = parallel.sequence`` workers of a group each hold ``T / N`` tokens of the same sequences (the
groups: :meth:`pretrain.parallel.dims.ParallelDims.sequence_group`).

* Every worker of the group gets the whole batch and keeps its slice (:meth:`SequenceShards.local`): token ids,
  and targets taken *before* slicing, so a decoder's last position of one slice predicts the first token of the
  next one (:meth:`SequenceShards.local_targets`).
* Positions are global: learned position embeddings and the RoPE tables are read at the slice's offset.
* Attention goes through DeepSpeed's :class:`~deepspeed.sequence.layer.DistributedAttention`: an all-to-all turns
  (B, T/N, H, hd) sequence shards into (B, T, H/N, hd) head shards, attention runs over the whole sequence (the
  causal mask is global) for ``H / N`` heads, and a second all-to-all turns the output back. Under GQA the query
  heads of one key-value head stay on one worker (DeepSpeed partitions along key-value heads).
* The loss is the token mean over the whole sequence: each worker returns ``N x (its CE sum) / (the group's target
  count)``, so the mean over the group's workers is the sequence mean and DeepSpeed's gradient average over all
  workers equals the average over the data-parallel ranks (see :meth:`SequenceShards.token_mean`).
* Without gradients (validation, scoring) the logits are gathered, so a scorer sees whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain import ds_adapter
from pretrain.model import Transformer
from pretrain.model.layers import Attention
from pretrain.model.score import IGNORE
from pretrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class SequenceShards:
    """This worker's place in its sequence-parallel group."""

    group: dist.ProcessGroup
    """The ``size`` workers that share each sequence."""
    index: int
    """This worker's slice: tokens ``[index * T / size, (index + 1) * T / size)``."""
    size: int

    def span(self, t: int) -> slice:
        """The positions of this worker's slice of a sequence of ``t`` tokens."""
        if t % self.size:
            raise ValueError(f"sequence length {t} is not divisible by parallel.sequence {self.size}")
        n = t // self.size
        return slice(self.index * n, (self.index + 1) * n)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> this worker's (B, T / size, ...) slice."""
        return x[:, self.span(x.shape[1])]

    def local_targets(self, labels: torch.Tensor, causal: bool) -> torch.Tensor:
        """The target of each of this worker's positions (decoders: the next token, across slice boundaries)."""
        if causal:
            labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)
        return self.local(labels)

    def token_mean(self, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``size x sum(values * keep) / (targets of the whole group)``: averaged over the group's workers, the fp32
        token mean over whole sequences (0 without any target); its gradient is this worker's share of it."""
        count = keep.sum().float()
        dist.all_reduce(count, group=self.group)  # a count: no gradient flows through it
        return (values.float() * keep).sum() * self.size / count.clamp(min=1.0)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """:meth:`token_mean` of the cross-entropy of local ``logits`` (B, t, V) against ``targets`` (B, t)."""
        flat = targets.reshape(-1)
        ce = F.cross_entropy(logits.float().reshape(flat.numel(), -1), flat, ignore_index=IGNORE, reduction="none")
        return self.token_mean(ce, (flat != IGNORE).float())

    @torch.no_grad()
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, t, ...) slices of every worker of the group -> (B, T, ...), in slice order (no gradient)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


def ulysses_attention(attn, group: dist.ProcessGroup):
    """DeepSpeed's ``DistributedAttention`` around ``attn``'s own attention core, for (B, t, heads, hd) q/k/v."""

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # (B, T, h, hd) each
        y = attn.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, h, T, hd)
        return y.transpose(1, 2)  # (B, T, h, hd)

    return ds_adapter.distributed_attention(core, group)


def apply_sequence_parallel(model: Transformer, dims: ParallelDims) -> None:
    """Make ``model`` keep its slice of every sequence and attend through DeepSpeed's Ulysses all-to-all, for
    ``parallel.sequence`` > 1 (collective: the groups are created the first time); nothing otherwise."""
    if dims.sequence == 1:
        return
    group, index = dims.sequence_group()
    model.sequence_shards = SequenceShards(group, index, dims.sequence)
    for block in model.blocks:
        attn = cast(Attention, block.attn)
        attn.use_ulysses(ulysses_attention(attn, group))
