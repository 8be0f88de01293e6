"""Token-choice top-k Mixture-of-Experts FFN (single-device code; expert parallelism is applied from outside).

Routing (same as Hugging Face Mixtral / Qwen3-MoE / OLMoE, so exports are exact): fp32 softmax over the
router logits, top-k, optionally renormalized; each token's output is the weighted sum of its experts'
SwiGLU/GELU FFNs, accumulated in expert order (``index_add_``: in that order on CPU, bitwise reproducible there; on
CUDA its atomic adds take any order, so with top_k >= 3 the sum may differ in its last bits from run to run): the
top-k MoE FFN of T. Xiao and J. Zhu, "Introduction to Transformers: an NLP Perspective" (arXiv:2311.17633), sec.
4.4, eqs. 114, 115 and 118 (after Shazeer et al. 2017).
The training objective adds the Switch Transformer load-balancing loss (Fedus et al. 2021, arXiv:2101.03961) and
the router z-loss (ST-MoE: Zoph et al. 2022, arXiv:2202.08906). With ``capacity_factor > 0`` training drops
assignments beyond ceil(factor * tokens * k / E) per expert of this worker's micro-batch (first choices first, then
token order), so the drop decision never depends on other workers; evaluation is dropless.

The layer is built with all E experts. Expert parallelism (``pretrain/parallel/expert.py``) keeps, on
expert-parallel rank r of ``ep_size``, experts [r*E/ep, (r+1)*E/ep) only, and routes the tokens, sorted by
expert, through ``exchange`` (the all-to-all to the workers holding the experts and back); with ``ep_size`` 1
they run on the local experts.

State-dict keys follow DeepSpeed's MoE names (its MoE checkpoint format requires them; they are our module names,
model code reads no DeepSpeed attribute):
``deepspeed_moe.gate.wg.weight`` (router, (E, D)) and
``deepspeed_moe.experts.deepspeed_experts.{e}.{gate,up,down}_proj.weight`` with global expert ids e.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.config import ModelConfig, MoEConfig
from pretrain.model.layers import FeedForward

STAT_FIELDS = ("routed", "kept", "tokens", "entropy", "balance", "z")
"""Per-layer statistics after the per-expert counts: routed/kept assignments, tokens, sum of router entropy,
sum of load-balancing loss and router z-loss values over forwards (the last two divided by ``forwards``)."""


LEGACY_BIAS = "expert_bias"
"""The selection bias's name in checkpoints written before it was ``selection_bias`` (and in the bundled
remote-code modeling file, which stays byte for byte): loaded under either."""


class _Gate(nn.Module):
    def __init__(self, hidden: int, num_experts: int, selection_bias: bool = False) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False)
        if selection_bias:  # auxiliary-loss-free balancing: saved with the model, updated outside autograd
            # No "expert" in its name: DeepSpeed's MoE checkpoint takes every such key of an MoE layer (but the
            # router's) for an expert's weight and fails on it under expert parallelism.
            self.register_buffer("selection_bias", torch.zeros(num_experts))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001 - torch's signature
        if prefix + LEGACY_BIAS in state_dict:
            state_dict[prefix + "selection_bias"] = state_dict.pop(prefix + LEGACY_BIAS)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_size: int, count: int) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(FeedForward(cfg, ffn_size) for _ in range(count))


class _Inner(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ffn_size: int, num_experts: int, local: int, selection_bias: bool = False
    ) -> None:
        super().__init__()
        self.gate = _Gate(cfg.hidden_size, num_experts, selection_bias)
        self.experts = _Experts(cfg, ffn_size, local)


class MoEFeedForward(nn.Module):
    """Drop-in replacement of :class:`FeedForward` holding experts ``[ep_rank * E_local, (ep_rank+1) * E_local)``.

    After each forward, ``aux_loss`` holds the weighted auxiliary objective of that forward (load balancing +
    router z-loss) to add to the training loss, and (training only) :meth:`commit_stats` adds its routing
    statistics to ``stats`` until :meth:`take_stats`."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, ffn_size: int) -> None:
        nn.Module.__init__(self)  # not super(): an expert-parallel subclass skips DeepSpeed MoE's __init__
        self.num_experts = moe.num_experts
        # Built with every expert; pretrain/parallel/expert.py keeps a worker's slice (ep_size > 1).
        self.ep_size = 1
        self.ep_rank = 0
        self.num_local_experts = moe.num_experts
        self.top_k = moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.normalize_top_k = moe.renormalizes  # top-1: Switch's weight p (p/p = 1 would starve the router)
        # balance: bias drops the Switch loss; its selection bias lives on the gate (see _Gate)
        self.aux_loss_weight = moe.aux_loss_weight if moe.balance != "bias" else 0.0
        self.bias_rate = moe.bias_rate
        self.router_z_loss_weight = moe.router_z_loss_weight
        self.ffn_size = ffn_size
        self.deepspeed_moe = _Inner(cfg, ffn_size, moe.num_experts, self.num_local_experts, moe.selection_bias)
        self.exchange: Callable[[MoEFeedForward, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """(layer, tokens sorted by global expert, per-expert counts) -> expert outputs in the same order;
        required when ep_size > 1 (see pretrain/parallel/expert.py)."""
        self.grouped_experts = True
        """Whether the local experts may run as one grouped GEMM (where device and dtype support it) rather than
        module by module; the training side turns it off when the expert weights are partitioned (ZeRO-3 gathers
        a weight only when its own module runs)."""
        self.aux_loss: torch.Tensor | None = None
        self.stats: torch.Tensor | None = None
        self.pending_stats: torch.Tensor | None = None

    @property
    def router(self) -> nn.Linear:
        return self.deepspeed_moe.gate.wg

    @property
    def selection_bias(self) -> torch.Tensor | None:
        """(E,) fp32 bias added to the router probabilities for choosing experts (``moe.balance: bias|both``)."""
        return getattr(self.deepspeed_moe.gate, "selection_bias", None)

    @torch.no_grad()
    def update_bias(self, routed: torch.Tensor) -> None:
        """DeepSeek-V3's update b_e += rate * sign(mean load - load_e) from one step's routed assignments per
        expert (summed over all ranks, so every rank applies the same update)."""
        bias = self.selection_bias
        if bias is None or not float(routed.sum()):
            return
        load = routed.to(device=bias.device, dtype=bias.dtype)
        bias.add_(torch.sign(load.mean() - load), alpha=self.bias_rate)

    @property
    def experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        h = x.reshape(-1, x.shape[-1])  # (N, D)
        n, e, k = h.shape[0], self.num_experts, self.top_k
        logits = self.router(h).float()  # (N, E)
        probs = logits.softmax(dim=-1)
        bias = self.selection_bias
        if bias is None:
            weights, chosen = probs.topk(k, dim=-1)  # (N, k)
        else:  # the bias picks the experts; the combine weights stay the router's probabilities
            chosen = (probs + bias.float()).topk(k, dim=-1).indices
            weights = probs.gather(-1, chosen)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        expert = chosen.t().reshape(-1)  # (kN,) first choices of all tokens, then second choices
        token = torch.arange(n, device=h.device).repeat(k)
        weight = weights.t().reshape(-1)
        routed = expert_counts(expert, e)
        if self.training and self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * n * k / e)
            onehot = F.one_hot(expert, e)  # (kN, E)
            position = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # arrival order within the expert
            keep = position < capacity
            expert, token, weight = expert[keep], token[keep], weight[keep]
        order = torch.argsort(expert, stable=True)
        expert, token, weight = expert[order], token[order], weight[order]
        counts = expert_counts(expert, e)  # (E,) kept assignments per expert
        y = self._run_experts(h[token], counts)  # (M, D), rows in (expert, arrival) order
        y = (y * weight.unsqueeze(-1)).to(h.dtype)  # fp32 weights, like HF
        out = torch.zeros_like(h).index_add_(0, token, y)

        balance = e * torch.dot(routed.float() / (n * k), probs.mean(0))
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        self.aux_loss = self.aux_loss_weight * balance + self.router_z_loss_weight * z
        # an eval forward leaves no row: one left by a recomputation during backward would be committed otherwise
        self.pending_stats = self._stats_row(routed, counts, n, probs, balance, z) if self.training else None
        return out.view_as(x)

    # Eager even inside a compiled block (see :func:`keep_experts_eager`).
    def _run_experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.exchange is not None:
            return self.exchange(self, tokens, counts)
        if self.ep_size > 1:
            raise RuntimeError(
                "an MoE layer with parallel.expert > 1 needs its all-to-all exchange "
                "(pretrain.parallel.expert.apply_expert_parallel)"
            )
        return self.run_local(tokens, counts)

    def run_local(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by local expert, ``counts`` per local expert -> outputs. Every local expert runs (on
        zero rows if it got none), so every rank produces all its expert gradients.

        One grouped matmul per projection over all local experts (``torch.nn.functional.grouped_mm``) where the
        device and dtype support it, else a loop over the experts (same results within fp32 rounding: tested)."""
        # grouped_mm wants 16-byte aligned row strides (e.g. fp32 sizes that are multiples of 4)
        sizes = (tokens.shape[-1], cast(FeedForward, self.experts[0]).up_proj.out_features)
        aligned = all(n * tokens.element_size() % 16 == 0 for n in sizes)
        if self.grouped_experts and aligned and grouped_mm_supported(tokens.device, tokens.dtype):
            return grouped_ffn(self.experts, tokens, counts)
        return loop_ffn(self.experts, tokens, counts)

    @torch.no_grad()
    def _stats_row(self, routed, kept, n, probs, balance, z) -> torch.Tensor:
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
        extra = torch.stack(
            [
                routed.sum().float(),
                kept.sum().float(),
                torch.tensor(float(n), device=z.device),
                entropy,
                balance.detach(),
                z.detach(),
            ]
        )
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


def expert_counts(expert: torch.Tensor, e: int) -> torch.Tensor:
    """(E,) int64 assignments per expert, on the device without a host read (CUDA's ``bincount`` reads the
    largest index to size its output); integer adds, so exact and deterministic."""
    return torch.zeros(e, dtype=torch.long, device=expert.device).scatter_add_(0, expert, torch.ones_like(expert))


def loop_ffn(experts: nn.ModuleList, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The experts one after the other on their slices of ``tokens`` (the reference for :func:`grouped_ffn`)."""
    pieces = tokens.split(counts.tolist())
    return torch.cat([ffn(p) for ffn, p in zip(experts, pieces)])


def grouped_ffn(experts: nn.ModuleList, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """All experts' FFNs on the token-sorted rows in one grouped GEMM per projection: the expert weights are
    stacked (E, in, out) views of the per-expert parameters (whose names the checkpoints key on), and group e
    is rows ``[sum(counts[:e]), sum(counts[:e+1]))``."""
    offs = counts.cumsum(0).to(torch.int32)

    def proj(x: torch.Tensor, name: str) -> torch.Tensor:
        linears = [getattr(f, name) for f in experts]
        weight = torch.stack([m.weight for m in linears]).transpose(1, 2).to(x.dtype)  # autocast's cast
        y = F.grouped_mm(x, weight, offs=offs)
        if linears[0].bias is not None:
            y = y + torch.repeat_interleave(
                torch.stack([m.bias for m in linears]).to(y.dtype), counts, dim=0, output_size=x.shape[0]
            )
        return y

    if experts[0].gated:
        hidden = F.silu(proj(tokens, "gate_proj")) * proj(tokens, "up_proj")
    else:
        hidden = F.gelu(proj(tokens, "up_proj"))
    return proj(hidden, "down_proj")


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs forward and backward for ``dtype`` on ``device`` in this torch build
    (CUDA builds need a recent GPU; older torch has no grouped_mm at all). Probed once per device and dtype, with
    autograd on whatever the caller's mode (a first call under ``torch.no_grad()`` must not cache a False)."""
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(4, 8, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
            F.grouped_mm(x, w, offs=torch.tensor([1, 4], device=device, dtype=torch.int32)).square().sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def prepare_experts(model: nn.Module, x: torch.Tensor) -> None:
    """Probe :func:`grouped_mm_supported` for the hidden states ``x`` before the blocks run, where the model recomputes
    blocks in backward: the probe's own forward and backward inside a checkpointed block would be recorded as the
    block's (a first step's recomputation then finds fewer saved tensors, or a second backward)."""
    for _, layer in moe_layers(model):
        if layer.grouped_experts:  # the experts' inputs: the hidden states' dtype, or their weights' (all alike)
            for dtype in {x.dtype, next(layer.experts.parameters()).dtype}:
                grouped_mm_supported(x.device, dtype)  # cached: a lookup after the first call
            return


def moe_layers(model: nn.Module) -> list[tuple[int, MoEFeedForward]]:
    """(block index, layer) of every MoE FFN of a :class:`Transformer`."""
    return [(i, b.ffn) for i, b in enumerate(getattr(model, "blocks", [])) if isinstance(b.ffn, MoEFeedForward)]


def routing_metrics(stats: dict[int, torch.Tensor]) -> dict[str, float]:
    """MLflow metrics from reduced statistics (block -> ``take_stats`` row summed over ranks):
    ``moe/block{i}/expert{e}_tokens`` (routed assignments), ``max_share`` (the share of the tokens routed to the
    busiest expert: :func:`max_shares`),
    ``dropped_frac``, ``router_entropy`` (nats, mean over tokens), ``aux_loss`` (load balancing, unweighted,
    1.0 when perfectly balanced) and ``router_z_loss``; nothing of a block that did not run (skipped by layer
    dropout: no tokens to speak of)."""
    out: dict[str, float] = {}
    for block, row in sorted(stats.items()):
        if float(row[-1]) == 0:
            continue
        e = row.numel() - len(STAT_FIELDS) - 1
        routed = row[:e]
        named = dict(zip(STAT_FIELDS, row[e:-1].tolist()))
        forwards = max(float(row[-1]), 1.0)
        total = max(named["routed"], 1.0)
        prefix = f"moe/block{block}/"
        out.update({f"{prefix}expert{j}_tokens": float(c) for j, c in enumerate(routed.tolist())})
        out[prefix + "max_share"] = float(routed.max()) / max(named["tokens"], 1.0)
        out[prefix + "dropped_frac"] = 1.0 - named["kept"] / total
        out[prefix + "router_entropy"] = named["entropy"] / max(named["tokens"], 1.0)
        out[prefix + "aux_loss"] = named["balance"] / forwards
        out[prefix + "router_z_loss"] = named["z"] / forwards
    return out


def update_balance_biases(model: nn.Module, stats: dict[int, torch.Tensor]) -> None:
    """After an optimizer step: nudge every MoE layer's selection bias by the step's load (``stats``: block ->
    reduced ``take_stats`` row, whose first E entries are the routed assignments per expert)."""
    for block, layer in moe_layers(model):
        if layer.selection_bias is not None and block in stats:
            layer.update_bias(stats[block][: layer.num_experts])


@contextmanager
def routing_stats_discarded(model: nn.Module) -> Iterator[None]:
    """Every MoE layer's routing statistics (committed and pending) are as they were on entry when the block
    exits: the forwards inside count nowhere (not in the load that moves the selection biases, the ``moe/`` metrics
    or collapse detection)."""
    layers = [layer for _, layer in moe_layers(model)]
    saved = [(layer.stats, layer.pending_stats) for layer in layers]
    try:
        yield
    finally:
        for layer, (stats, pending) in zip(layers, saved):
            layer.stats, layer.pending_stats = stats, pending


@contextmanager
def routing_state_kept(model: nn.Module) -> Iterator[None]:
    """Every MoE layer's selection bias (values restored in place) and routing statistics are as they were on entry
    when the block exits, whatever ran inside (a step that must not count as training)."""
    biases = [(b, b.detach().clone()) for _, layer in moe_layers(model) if (b := layer.selection_bias) is not None]
    try:
        with routing_stats_discarded(model):
            yield
    finally:
        with torch.no_grad():
            for bias, value in biases:
                bias.copy_(value)


def max_shares(stats: dict[int, torch.Tensor]) -> dict[int, float]:
    """Block -> share of its tokens routed to its busiest expert (in [0, 1] whatever ``top_k``: an expert takes at
    most one of a token's k assignments; ``top_k / num_experts`` when balanced), for the blocks that ran (a block
    layer dropout skipped has no share: a router-collapse streak is held over it, not reset)."""
    out = {}
    for block, row in stats.items():
        if float(row[-1]) == 0:
            continue
        e = row.numel() - len(STAT_FIELDS) - 1
        out[block] = float(row[:e].max()) / max(float(row[e + 2]), 1.0)  # row[e + 2]: tokens
    return out


def keep_experts_eager() -> None:
    """Run the experts eagerly inside compiled blocks (``torch.compiler.disable`` on
    :meth:`MoEFeedForward._run_experts`): the token counts are data, and grouped_mm has no CPU fp32 meta kernel.
    Called before a block is compiled (:func:`pretrain.model.compile.compile_blocks`), not at import: the decorator
    imports ``torch._dynamo`` (a slow import), which an eager run never needs. Idempotent; in eager mode the
    disabled method runs as the plain one."""
    if not getattr(MoEFeedForward._run_experts, "_eager_under_compile", False):
        eager = torch.compiler.disable(MoEFeedForward._run_experts)
        eager._eager_under_compile = True
        MoEFeedForward._run_experts = eager  # type: ignore[method-assign]  # deliberate patch: the compiler-disabled method
