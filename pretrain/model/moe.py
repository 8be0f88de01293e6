"""Token-choice top-k Mixture-of-Experts FFN, with expert parallelism over an all-to-all.

Routing (same as Hugging Face Mixtral / Qwen3-MoE / OLMoE, so exports are exact): fp32 softmax over the
router logits, top-k, optionally renormalized; each token's output is the weighted sum of its experts'
SwiGLU/GELU FFNs, accumulated in expert order. With ``capacity_factor > 0`` training drops assignments
beyond ceil(factor * tokens * k / E) per expert of this worker's micro-batch (first choices first, then
token order), so the drop decision never depends on other workers; evaluation is dropless.

Expert parallelism (``ep_size > 1``): worker r of an EP group holds experts [r*E/ep, (r+1)*E/ep). Routed
tokens are sorted by expert, their counts exchanged, and the tokens sent with ``all_to_all_single`` (autograd
sends the gradients back the same way). :func:`expert_parallel_class` adds DeepSpeed's MoE marker class so the
DeepSpeed engine reduces expert gradients only across the expert-data-parallel group, partitions their ZeRO-1/2
optimizer state there, and writes one checkpoint file per expert (``layer_{l}_expert_{e}_...``).

State-dict keys follow DeepSpeed's MoE names (which its checkpoint code keys on):
``deepspeed_moe.gate.wg.weight`` (router, (E, D)) and
``deepspeed_moe.experts.deepspeed_experts.{e}.{gate,up,down}_proj.weight`` with global expert ids e.
"""

from __future__ import annotations

import math
import time
from functools import lru_cache

import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F

from pretrain.config import ModelConfig, MoEConfig
from pretrain.model.layers import FeedForward

STAT_FIELDS = ("routed", "kept", "tokens", "entropy", "balance", "z")
"""Per-layer statistics after the per-expert counts: routed/kept assignments, tokens, sum of router entropy,
sum of load-balancing loss and router z-loss values over forwards (the last two divided by ``forwards``)."""


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; the backward sends gradients back along the reverse splits
    (its time is added to ``timer.comm_seconds`` when a timer is given)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, timer=None) -> torch.Tensor:
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
        if ctx.timer is not None:
            ctx.timer.comm_seconds += time.perf_counter() - t0
        return back, None, None, None, None


class _Gate(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False)


class _Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_size: int, count: int) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(FeedForward(cfg, ffn_size) for _ in range(count))


class _Inner(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_size: int, num_experts: int, local: int) -> None:
        super().__init__()
        self.gate = _Gate(cfg.hidden_size, num_experts)
        self.experts = _Experts(cfg, ffn_size, local)


class MoEFeedForward(nn.Module):
    """Drop-in replacement of :class:`FeedForward` holding experts ``[ep_rank * E_local, (ep_rank+1) * E_local)``.

    After each forward, ``aux_loss`` holds the weighted auxiliary objective of that forward (load balancing +
    router z-loss) to add to the training loss, and (training only) :meth:`commit_stats` adds its routing
    statistics to ``stats`` until :meth:`take_stats`."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, ffn_size: int, ep_rank: int = 0) -> None:
        nn.Module.__init__(self)  # not super(): the expert-parallel subclass must skip DeepSpeed MoE's __init__
        if moe.num_experts % moe.ep_size or not 0 <= ep_rank < moe.ep_size:
            raise ValueError(f"bad expert layout: {moe.num_experts} experts, ep_size {moe.ep_size}, rank {ep_rank}")
        self.num_experts = moe.num_experts
        self.ep_size = moe.ep_size
        self.ep_rank = ep_rank
        self.num_local_experts = moe.num_experts // moe.ep_size
        self.expert_group_name = f"ep_size_{moe.ep_size}"  # DeepSpeed's group key
        self.top_k = moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.normalize_top_k = moe.normalize_top_k
        self.aux_loss_weight = moe.aux_loss_weight
        self.router_z_loss_weight = moe.router_z_loss_weight
        self.ffn_size = ffn_size
        self.deepspeed_moe = _Inner(cfg, ffn_size, moe.num_experts, self.num_local_experts)
        self.ep_group = None  # set by set_deepspeed_parallelism (or a test) when ep_size > 1
        self.comm_seconds = 0.0  # wall time in all-to-alls, forward and backward (incl. waiting for peers)
        self.aux_loss: torch.Tensor | None = None
        self.stats: torch.Tensor | None = None
        self.pending_stats: torch.Tensor | None = None
        self.mark_expert_params()

    @property
    def router(self) -> nn.Linear:
        return self.deepspeed_moe.gate.wg

    @property
    def experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def mark_expert_params(self) -> None:
        """Tag expert parameters the way DeepSpeed recognizes them (``is_moe_param``) when they are expert
        parallel; with ep_size 1 they stay ordinary data-parallel parameters. Call again after ``to_empty``."""
        if self.ep_size == 1:
            return
        for p in self.experts.parameters():
            p.allreduce = False
            p.group_name = self.expert_group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        h = x.reshape(-1, x.shape[-1])  # (N, D)
        n, e, k = h.shape[0], self.num_experts, self.top_k
        logits = self.router(h).float()  # (N, E)
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # (N, k)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        expert = chosen.t().reshape(-1)  # (kN,) first choices of all tokens, then second choices
        token = torch.arange(n, device=h.device).repeat(k)
        weight = weights.t().reshape(-1)
        routed = torch.bincount(expert, minlength=e)
        if self.training and self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * n * k / e)
            onehot = F.one_hot(expert, e)  # (kN, E)
            position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # arrival order within the expert
            keep = position < capacity
            expert, token, weight = expert[keep], token[keep], weight[keep]
        order = torch.argsort(expert, stable=True)
        expert, token, weight = expert[order], token[order], weight[order]
        counts = torch.bincount(expert, minlength=e)  # (E,) kept assignments per expert
        y = self._run_experts(h[token], counts)  # (M, D), rows in (expert, arrival) order
        y = (y * weight.unsqueeze(-1)).to(h.dtype)  # fp32 weights, like HF
        out = torch.zeros_like(h).index_add_(0, token, y)

        balance = e * torch.dot(routed.float() / (n * k), probs.mean(0))
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.aux_loss = self.aux_loss_weight * balance + self.router_z_loss_weight * z
        if self.training:
            self.pending_stats = self._stats_row(routed, counts, n, probs, balance, z)
        return out.view_as(x)

    def _run_experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every local expert runs (on zero rows if it got none), so every rank produces all expert gradients."""
        if self.ep_size == 1:
            pieces = tokens.split(counts.tolist())
            return torch.cat([ffn(p) for ffn, p in zip(self.experts, pieces)])
        if self.ep_group is None:
            raise RuntimeError("MoE with moe.ep_size > 1 needs its expert-parallel group "
                               "(DeepSpeed sets it at initialize; see set_deepspeed_parallelism)")
        ep, local = self.ep_size, self.num_local_experts
        t0 = time.perf_counter()
        recv_counts = torch.empty_like(counts)
        tdist.all_to_all_single(recv_counts, counts, group=self.ep_group)  # (ep * local,) source-major
        send_splits = counts.view(ep, local).sum(1).tolist()
        recv_table = recv_counts.view(ep, local)
        recv = _AllToAll.apply(tokens, recv_table.sum(1).tolist(), send_splits, self.ep_group, self)
        self.comm_seconds += time.perf_counter() - t0
        segments = recv.split(recv_table.flatten().tolist())  # [(source, expert)] source-major
        outs = [ffn(torch.cat([segments[s * local + j] for s in range(ep)])) for j, ffn in enumerate(self.experts)]
        per_expert = [o.split(recv_table[:, j].tolist()) for j, o in enumerate(outs)]
        back = torch.cat([per_expert[j][s] for s in range(ep) for j in range(local)])
        t0 = time.perf_counter()
        out = _AllToAll.apply(back, send_splits, recv_table.sum(1).tolist(), self.ep_group, self)
        self.comm_seconds += time.perf_counter() - t0
        return out

    @torch.no_grad()
    def _stats_row(self, routed, kept, n, probs, balance, z) -> torch.Tensor:
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
        extra = torch.stack([routed.sum().float(), kept.sum().float(), torch.tensor(float(n), device=z.device),
                             entropy, balance.detach(), z.detach()])
        return torch.cat([routed.float(), extra, torch.ones(1, device=z.device)])

    def commit_stats(self) -> None:
        """Count the last training forward's statistics. The model calls this after the block ran, so the
        re-run of the forward under activation checkpointing (during backward) is not counted twice."""
        row, self.pending_stats = self.pending_stats, None
        if row is not None:
            self.stats = row if self.stats is None else self.stats + row

    def take_stats(self) -> torch.Tensor:
        """(E + len(STAT_FIELDS) + 1,) fp32 sums since the last call (routed per expert, then ``STAT_FIELDS``,
        then the number of forwards); zeros when none ran."""
        stats = self.stats
        self.stats = None
        if stats is None:
            return torch.zeros(self.num_experts + len(STAT_FIELDS) + 1, device=self.router.weight.device)
        return stats

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by the DeepSpeed engine: create (once) and adopt the expert-parallel process groups."""
        from deepspeed.utils import groups

        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.ep_group = groups._get_expert_parallel_group(self.expert_group_name)
        rank = groups._get_expert_parallel_rank(self.expert_group_name)
        if rank != self.ep_rank:
            raise RuntimeError(f"expert layout mismatch: built for EP rank {self.ep_rank}, DeepSpeed says {rank}")


@lru_cache(maxsize=1)
def expert_parallel_class() -> type:
    """``MoEFeedForward`` that is also a ``deepspeed.moe.layer.MoE``, so the DeepSpeed engine treats it as an
    MoE layer (expert gradient groups, per-expert checkpoint files). Its ``__init__`` is ours."""
    from deepspeed.moe.layer import MoE

    return type("ExpertParallelMoE", (MoEFeedForward, MoE), {"__module__": __name__})


def expert_parallel_rank(rank: int, ep_size: int) -> int:
    """EP rank of global ``rank`` in DeepSpeed's layout (expert-parallel groups are consecutive ranks)."""
    return rank % ep_size


def make_moe_ffn(cfg: ModelConfig, moe: MoEConfig, ffn_size: int, rank: int = 0) -> MoEFeedForward:
    if moe.ep_size == 1:
        return MoEFeedForward(cfg, moe, ffn_size)
    return expert_parallel_class()(cfg, moe, ffn_size, expert_parallel_rank(rank, moe.ep_size))


def moe_layers(model: nn.Module) -> list[tuple[int, MoEFeedForward]]:
    """(block index, layer) of every MoE FFN of a :class:`Transformer`."""
    return [(i, b.ffn) for i, b in enumerate(getattr(model, "blocks", [])) if isinstance(b.ffn, MoEFeedForward)]


def routing_metrics(stats: dict[int, torch.Tensor]) -> dict[str, float]:
    """MLflow metrics from reduced statistics (block -> ``take_stats`` row summed over ranks):
    ``moe/block{i}/expert{e}_tokens`` (routed assignments), ``max_share`` (busiest expert's share),
    ``dropped_frac``, ``router_entropy`` (nats, mean over tokens), ``aux_loss`` (load balancing, unweighted,
    1.0 when perfectly balanced) and ``router_z_loss``."""
    out: dict[str, float] = {}
    for block, row in sorted(stats.items()):
        e = row.numel() - len(STAT_FIELDS) - 1
        routed = row[:e]
        named = dict(zip(STAT_FIELDS, row[e:-1].tolist()))
        forwards = max(float(row[-1]), 1.0)
        total = max(named["routed"], 1.0)
        prefix = f"moe/block{block}/"
        out.update({f"{prefix}expert{j}_tokens": float(c) for j, c in enumerate(routed.tolist())})
        out[prefix + "max_share"] = float(routed.max()) / total
        out[prefix + "dropped_frac"] = 1.0 - named["kept"] / total
        out[prefix + "router_entropy"] = named["entropy"] / max(named["tokens"], 1.0)
        out[prefix + "aux_loss"] = named["balance"] / forwards
        out[prefix + "router_z_loss"] = named["z"] / forwards
    return out


def max_shares(stats: dict[int, torch.Tensor]) -> dict[int, float]:
    """Block -> share of the routed assignments taken by its busiest expert."""
    m = routing_metrics(stats)
    return {block: m[f"moe/block{block}/max_share"] for block in stats}
