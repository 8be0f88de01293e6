"""Health metrics of a DeepSpeed engine, from what each rank holds, reduced across ranks.

Every step needs only :func:`grad_signals` (one pass over this rank's gradient shard). On health steps
a :class:`HealthProbe` additionally records per-block gradient norms, parameter norms, update/parameter
ratios, activation RMS and max (forward hooks on the first micro-batch), the attention logit max (a side
q.k^T, see ``Attention.probe_logits``), the output logit mean square and the z-loss term, and
non-finite gradient counts.

Where the numbers live depends on the ZeRO stage (at the accumulation boundary before ``engine.step()``): this
rank's gradient and parameter partitions under ZeRO, the full tensors otherwise; :mod:`pretrain.ds_adapter`
(``grad_views``, ``local_param_views``) finds them.

Replicated tensors (identical on every rank) are counted once before a sum all-reduce: on rank 0, or for an
expert-parallel weight on the first rank of its expert-data-parallel group, so every layout gives the same
global numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as tdist

from pretrain import ds_adapter
from pretrain.model.compile import is_compiled
from pretrain.parallel.dims import ParallelDims

Views = list[tuple[torch.nn.Parameter, torch.Tensor]]


def _rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else 0


def _world() -> int:
    return tdist.get_world_size() if tdist.is_initialized() else 1


def _owner(p: torch.nn.Parameter, dims: ParallelDims) -> bool:
    """Whether this rank counts replicated expert or tensor-parallel ``p`` in a cross-rank sum: for an
    expert-parallel weight (DeepSpeed's ``allreduce = False``) the first rank of its expert-data-parallel group,
    since each expert-parallel rank holds other experts; for a tensor-parallel shard the ranks of the first
    tensor-parallel group (ranks ``0 .. M-1``), each holding its own shard. The positions come from ``dims``."""
    rank = _rank()
    if ds_adapter.is_expert_param(p):
        return dims.expert_data_rank(rank) == 0
    return rank < dims.tensor


def _owned(views: Views, dims: ParallelDims) -> Views:
    """The replicated values this rank counts: expert weights and tensor-parallel shards by :func:`_owner`; the
    dense weights every rank holds whole are dealt out over the ranks by size (each to the rank with the fewest
    elements so far, in the views' order, which is every rank's), so that the update ratio's snapshot of them
    (:meth:`HealthProbe.before_update`) is about ``1/world`` of the weights on each rank, not all of them on one."""
    rank, out = _rank(), []
    load = [0] * dims.world
    for p, t in views:
        if ds_adapter.is_expert_param(p) or is_shard(p):
            if _owner(p, dims):
                out.append((p, t))
            continue
        owner = load.index(min(load))
        load[owner] += t.numel()
        if owner == rank:
            out.append((p, t))
    return out


def is_shard(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` is this rank's AutoTP shard of a split weight (``parallel.tensor.mark_shards`` marks it)."""
    return bool(getattr(p, "tensor_parallel_shard", False))


def _once_per_tensor_group(views: Views, dims: ParallelDims) -> Views:
    """Under tensor parallelism, ZeRO partitions of weights every tensor-parallel rank holds whole (norms, embeddings,
    the head) are counted by the first rank of each tensor-parallel group only."""
    if dims.tensor_rank(_rank()) == 0:
        return views
    return [(p, t) for p, t in views if is_shard(p)]


def block_key(name: str) -> str:
    """Parameter name -> its group: ``blockNN`` for block NN, ``embed`` or ``head`` otherwise."""
    parts = name.split(".")
    if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
        return f"block{int(parts[1]):02d}"
    return "embed" if parts[0] in ("embed_tokens", "embed_positions", "embedding_norm") else "head"


def grad_views(engine, dims: ParallelDims) -> Views:
    """(parameter, gradient) pairs this rank contributes to cross-rank sums: its ZeRO partition, or the replicated
    gradients it owns (see :func:`_owner`)."""
    views, replicated = ds_adapter.grad_views(engine)
    return _owned(views, dims) if replicated else _once_per_tensor_group(views, dims)


def param_views(engine) -> tuple[Views, bool]:
    """(parameter, this rank's values of it): ZeRO-3 partitions, else the full (replicated) tensors."""
    return ds_adapter.local_param_views(engine)


def counted_param_views(engine, dims: ParallelDims) -> Views:
    """The parameter values this rank contributes to cross-rank sums (each value counted once overall)."""
    views, replicated = param_views(engine)
    return _owned(views, dims) if replicated else _once_per_tensor_group(views, dims)


def grad_signals(engine, dims: ParallelDims, device: torch.device) -> torch.Tensor:
    """This rank's (sum of squared gradients, 0/1 non-finite) contribution as a float64 (2,) tensor on ``device``,
    not read by the host (the step reads it with its other signals, once); sum them across ranks."""
    views = grad_views(engine, dims)
    if not views:
        return torch.zeros(2, dtype=torch.float64, device=device)
    # One fused pass, like clip_grad_norm_; accumulated in fp32 even for bf16 gradients.
    norms = torch._foreach_norm([g.detach() for _, g in views], 2, dtype=torch.float32)
    sq = torch.stack(norms).double().pow(2).sum().to(device)  # fp64: a huge norm must not overflow to inf
    return torch.stack([sq, (~torch.isfinite(sq)).double()])


def nonfinite_params(engine) -> float:
    """Non-finite parameter elements this rank holds (every rank checks its own copy or shard, so a
    corrupted replica is caught too); sum across ranks before deciding."""
    views, _ = param_views(engine)
    if not views:
        return 0.0
    norms = torch._foreach_norm([t for _, t in views], 2, dtype=torch.float32)
    if math.isfinite(float(torch.stack(norms).double().sum())):  # the common case: one fused pass
        return 0.0
    return float(sum(int((~torch.isfinite(t)).sum()) for _, t in views))


LOGIT_CHUNK = 1 << 24
"""Output-logit elements the probe copies to fp32 at a time (64 MiB; the memory plan counts two such copies)."""


class HealthProbe:
    """Collects one step's health metrics; every rank must call :meth:`reduce` (collective)."""

    def __init__(self, engine, dims: ParallelDims):
        self.engine = engine
        self.dims = dims
        self.model = engine.module
        self.keys = {id(p): block_key(n) for n, p in self.model.named_parameters()}
        self.groups = sorted(set(self.keys.values()))
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}
        self._hooks: list = []
        self._eager = False
        self._before: list[torch.Tensor] | None = None

    # -- forward of the first micro-batch -------------------------------------------------------

    def attach(self) -> None:
        """Hooks on every block (activation RMS/max) and attention logit probes, for one forward. Compiled blocks
        run that forward eagerly (``torch.compiler.set_stance("force_eager")`` until :meth:`detach`): new hooks
        and the probe flag inside a compiled block would recompile it on every probed step."""
        if hasattr(self.model, "blocks") and is_compiled(self.model) and hasattr(torch.compiler, "set_stance"):
            torch.compiler.set_stance("force_eager")
            self._eager = True
        for i, block in enumerate(getattr(self.model, "blocks", [])):
            self._hooks.append(block.register_forward_hook(self._activation_hook(f"block{i:02d}")))
            if hasattr(block, "attn"):
                block.attn.probe_logits = True

    def _activation_hook(self, key: str):
        def hook(_module, _inputs, output):
            x = output.detach().float()  # (B, T, D)
            self.sums[f"act_rms/{key}"] = float(x.pow(2).mean().sqrt()) / _world()  # mean over ranks
            self.maxes[f"act_max/{key}"] = float(x.abs().max())

        return hook

    def detach(self, output) -> None:
        """Remove the hooks; read the attention probes and the output logits of that forward."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._eager:
            torch.compiler.set_stance("default")
            self._eager = False
        for i, block in enumerate(getattr(self.model, "blocks", [])):
            attn = getattr(block, "attn", None)
            if attn is None:
                continue
            if attn.last_logit_max is not None:
                self.maxes[f"attn_logit_max/block{i:02d}"] = float(attn.last_logit_max)
            attn.probe_logits, attn.last_logit_max = False, None
        logits = output.logits.detach()  # (B, T, V)
        rows = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
        sq = lse = torch.zeros((), dtype=torch.float64, device=rows.device)
        for part in rows.split(max(1, LOGIT_CHUNK // rows.shape[-1])):  # fp32 copies of one chunk at a time
            x = part.float()
            sq = sq + x.pow(2).sum(dtype=torch.float64)
            lse = lse + torch.logsumexp(x, dim=-1).pow(2).sum(dtype=torch.float64)
        self.sums["logit_ms"] = float(sq / rows.numel()) / _world()
        self.sums["logsumexp_sq"] = float(lse / rows.shape[0]) / _world()
        if getattr(output, "z_loss", None) is not None:
            self.sums["z_loss"] = float(output.z_loss.detach()) / _world()

    # -- around the optimizer step --------------------------------------------------------------

    def before_update(self) -> None:
        """Per-block gradient norms and non-finite counts; snapshot the parameters for the update ratio."""
        views = grad_views(self.engine, self.dims)
        self._add_sq("grad_sq", views)
        finite = all(math.isfinite(v) for k, v in self.sums.items() if k.startswith("grad_sq/"))
        # Counting elements is a second pass: only needed when some norm is already non-finite.
        self.sums["nonfinite_grads"] = 0.0 if finite else float(sum(int((~torch.isfinite(g)).sum()) for _, g in views))
        self._before = [t.detach().clone() for _, t in counted_param_views(self.engine, self.dims)]

    def after_update(self) -> None:
        """Parameter norms and the norms of this step's update, per block."""
        pviews = counted_param_views(self.engine, self.dims)
        self._add_sq("param_sq", pviews)
        before = self._before or []
        diffs = torch._foreach_sub([t.detach() for _, t in pviews[: len(before)]], before) if before else []
        deltas = [(p, d) for (p, _), d in zip(pviews, diffs)]
        self._add_sq("update_sq", deltas)
        self._before = None

    def _add_sq(self, name: str, views: Iterable[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
        for g in self.groups:  # every rank has the same keys, so the all-reduce vectors line up
            self.sums.setdefault(f"{name}/{g}", 0.0)
        by_group: dict[str, list[torch.Tensor]] = {}
        for p, t in views:
            by_group.setdefault(self.keys.get(id(p), "head"), []).append(t.detach())
        for g, tensors in by_group.items():  # one fused norm pass per group, squared in fp64
            norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
            self.sums[f"{name}/{g}"] += float(torch.stack(norms).double().pow(2).sum())

    # -- the collective --------------------------------------------------------------------------

    def reduce(self, device: torch.device) -> dict[str, float]:
        """All-reduce (sums and maxes) and derive the reported metrics, named ``health/...``."""
        sums = _all_reduce(self.sums, device, tdist.ReduceOp.SUM if tdist.is_initialized() else None)
        maxes = _all_reduce(self.maxes, device, tdist.ReduceOp.MAX if tdist.is_initialized() else None)
        out: dict[str, float] = {}
        for metric, sq in (("grad_norm", "grad_sq"), ("param_norm", "param_sq")):
            parts = {g: sums.get(f"{sq}/{g}", 0.0) for g in self.groups}
            out[f"health/{metric}"] = math.sqrt(sum(parts.values()))
            out.update({f"health/{metric}/{g}": math.sqrt(v) for g, v in parts.items()})
        if any(k.startswith("update_sq/") for k in sums):
            upd = {g: sums[f"update_sq/{g}"] for g in self.groups}
            par = {g: sums[f"param_sq/{g}"] for g in self.groups}
            out["health/update_ratio"] = math.sqrt(sum(upd.values()) / max(sum(par.values()), 1e-30))
            out.update({f"health/update_ratio/{g}": math.sqrt(upd[g] / max(par[g], 1e-30)) for g in self.groups})
        for k, v in sums.items():
            if not k.startswith(("grad_sq/", "param_sq/", "update_sq/")):
                out[f"health/{k}"] = v
        out.update({f"health/{k}": v for k, v in maxes.items()})
        logit_max = [v for k, v in maxes.items() if k.startswith("attn_logit_max/")]
        if logit_max:
            out["health/attn_logit_max"] = max(logit_max)
        return out


def _all_reduce(values: dict[str, float], device: torch.device, op) -> dict[str, float]:
    keys = sorted(values)
    if not keys:
        return {}
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    if op is not None and tdist.get_world_size() > 1:
        tdist.all_reduce(t, op=op)
    return dict(zip(keys, t.tolist()))
