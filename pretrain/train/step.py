"""The step: one optimizer update over this rank's share of the global batch, and evaluation.

Everything that changes the math of an update (LR, micro-batching, z-loss, clipping via DeepSpeed, loss
averaging across ranks, dropping an update) lives here; the trainer around it only schedules, and
callbacks observe or extend it through :class:`StepHooks` (the stability guard, health probes, fault
injection).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from pretrain import ds_adapter
from pretrain.model.moe import moe_layers, routing_stats_discarded, update_balance_biases
from pretrain.model.score import IGNORE, ScoreSums, score_batches, targets
from pretrain.train import dist
from pretrain.train.health import grad_signals
from pretrain.train.stability.monitor import StepSignals


def step_seed(seed: int, step: int, index: int) -> int:
    """Seed of the global torch RNG (dropout) for one step and one rank or micro-batch id: resume needs
    no RNG replay, and with micro-batch ids the masks do not depend on the worker count."""
    return zlib.crc32(f"{seed}:{step}:{index}".encode()) & 0x7FFFFFFF


def dropout_seeds(seed: int, step: int, micro_ids: list[int], dims, rank: int) -> list[int]:
    """The dropout seed of each of global ``rank``'s micro-batches (ids ``micro_ids``) at 0-based ``step``
    (``dims``: the run's ``ParallelDims``). Workers of a tensor-parallel group share it (their activations are
    replicated); each worker of a sequence-parallel group has its own (one seed would repeat a slice's masks along
    the sequence, and over the head groups after the all-to-all). Without sequence parallelism it is the
    micro-batch's alone, whatever the worker count."""
    n, s = dims.sequence, dims.sequence_rank(rank)
    return [step_seed(seed, step, mid * n + s) for mid in micro_ids]


def _micro_batches(batch: dict[str, torch.Tensor], micro: int, device: torch.device):
    n = batch["input_ids"].shape[0]
    for i in range(0, n, micro):
        yield {k: v[i : i + micro].to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class StepInput:
    """What the trainer hands the step: this rank's share of one global batch and how to train on it."""

    step: int
    """1-based number of this optimizer step."""
    batch: dict[str, torch.Tensor]
    """``input_ids`` and ``labels``, (share, T) each: this rank's share of the global batch."""
    lr: float
    """Learning rate of this update."""
    seeds: list[int] | None = None
    """Seed of the global torch RNG (dropout) per real micro-batch, see ``RunPlan.micro_batch_ids``."""


class StepHooks:
    """Extension points inside one step, part of the callback contract (:mod:`pretrain.train.callbacks.base`, where
    the events around them are): callbacks subclass this; every method is a no-op by default. :func:`run_step`
    calls each hook on every callback in the callbacks' ``order``, at fixed points: per micro-batch
    ``before_forward`` and ``forward_kwargs`` (each callback's pair in turn), the forward, ``after_forward``,
    ``objective``, the backward; then ``after_backward``, ``decide``, ``before_update``, the optimizer update,
    ``after_update``. ``module`` is the :class:`~pretrain.train.module.TrainModule`. A hook that changes the math
    of the update must give every rank the same answer (``decide`` gets identical inputs on every rank)."""

    def before_forward(self, module, index: int) -> None:
        """Before the forward of micro-batch ``index`` (after its RNG seed is set): arm per-forward probes."""

    def forward_kwargs(self, module, index: int) -> dict[str, Any]:
        """Extra keyword arguments of the model's forward for micro-batch ``index`` (e.g. layer-drop gates); the
        callbacks' dicts are merged in order (a later callback's key wins)."""
        return {}

    def after_forward(self, module, index: int, output) -> None:
        """After the forward of micro-batch ``index`` (``output``: the model's output, before backward). Read only."""

    def objective(self, objective: torch.Tensor, index: int, count: int) -> torch.Tensor:
        """The objective of micro-batch ``index`` of ``count`` before backward (may wrap it); chained: each callback
        gets the previous one's result, and the last one's is what backward runs on."""
        return objective

    def after_backward(self, module) -> None:
        """After the last backward of the step, before the gradient norm and the update (gradients are there)."""

    def decide(self, signals: StepSignals) -> Any:
        """From the reduced signals (same on every rank), before the update: an object with a bool ``apply``, or
        None (no opinion). The first callback's answer that is not None is the step's decision
        (``StepResult.decision``); the later callbacks are not asked."""
        return None

    def before_update(self, module) -> None:
        """Right before the optimizer update (after the decision; an asynchronous save's copy has finished)."""

    def after_update(self, module) -> None:
        """Right after the optimizer update (or after the suppressed one, when the decision skipped it)."""


@dataclass
class StepResult:
    loss: float
    """The cross-entropy (without the z-loss term) as the token mean over all the step's targets (every rank's and
    micro-batch's), the objective's main term (see :func:`token_weights`)."""
    grad_norm: float
    """Global pre-clipping gradient norm (same on every rank)."""
    applied: bool = True
    """Whether the optimizer update was applied (False when a hook's decision skipped it)."""
    decision: Any = None
    """The decision a hook returned (None when no hook decided)."""
    moe: dict[int, torch.Tensor] = field(default_factory=dict)
    """Routing statistics of this step summed over all ranks and micro-batches, per MoE block index
    (see :func:`pretrain.model.moe.routing_metrics`); empty for dense models."""


def _padding(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch that only keeps the collectives matched: its objective is multiplied by 0."""
    return {"input_ids": torch.zeros_like(mb["input_ids"]), "labels": torch.full_like(mb["labels"], -100)}


def run_step(module, inp: StepInput, hooks: Sequence[StepHooks] = ()) -> StepResult:
    """One optimizer step of ``module`` (a :class:`~pretrain.train.module.TrainModule`) over this rank's share:

    * the plan's micro-batches (padded with zero-weight ones when the ranks' shares differ, whose MoE routing
      statistics are discarded), each seeded, forward, ``hooks.objective``, backward; each micro-batch's per-target
      terms weighted by its share of the step's targets (:func:`token_weights`), so the update follows the token mean
      of the whole global batch whatever the micro-batching and the worker count;
    * at the accumulation boundary, after the last backward and *before* the update, the loss, the squared
      gradient norm (from this rank's shard) and a non-finite flag are all-reduced in one collective, and the
      hooks' ``decide`` (same inputs on every rank) may drop the update, which leaves weights and optimizer
      state bitwise unchanged (:func:`update_suppressed`)."""
    engine, plan, device = module.engine, module.plan, module.device
    module.set_lr(inp.lr)
    mbs = list(_micro_batches(inp.batch, plan.micro_batch, device))
    real = len(mbs)
    mbs += [_padding(mbs[0]) for _ in range(plan.grad_accum - real)]
    weights = token_weights(inp.batch["labels"], plan, module.model.causal, device)
    scale = None if plan.even else plan.gradient_scale()
    losses = []
    for i, mb in enumerate(mbs):
        if inp.seeds is not None:
            torch.manual_seed(inp.seeds[i] if i < real else 0x7FFFFFFF - i)
        kwargs: dict[str, Any] = {}
        for h in hooks:
            h.before_forward(module, i)
            kwargs.update(h.forward_kwargs(module, i))
        with routing_stats_discarded(engine.module) if i >= real else nullcontext():  # padding: routes nothing
            out = engine(mb["input_ids"], labels=mb["labels"], **kwargs)
        for h in hooks:
            h.after_forward(module, i, out)
        objective = out.objective(weights[i] if i < real else None)
        if scale is not None:
            objective = objective * (scale if i < real else 0.0)
        for h in hooks:
            objective = h.objective(objective, i, len(mbs))
        engine.backward(objective)
        if i < real:
            losses.append((out.loss * weights[i]).detach().float())  # read by the host once, after the last backward
        if i < len(mbs) - 1:
            engine.step()  # not a boundary: DeepSpeed only counts the micro-step
    for h in hooks:
        h.after_backward(module)
    world = torch.distributed.get_world_size()
    local = _loss_sum(losses, device)  # float64, summed in micro-batch order
    if scale is None:  # every rank ran the same number of real micro-batches
        local = local / len(losses)
    signals = torch.cat([local.view(1), grad_signals(engine, plan.dims, device)])
    if world > 1:
        torch.distributed.all_reduce(signals)
    # The step's one read by the host: the reduced loss and gradient signals, and the MoE routing statistics.
    (loss_sum, grad_sq, nonfinite), moe = read_signals(signals, engine.module, device)
    if scale is None:
        loss = loss_sum / world
    else:
        loss = loss_sum / (plan.real_micro_batches * plan.model_parallel)  # model parallel: ranks share batches
    grad_norm = math.sqrt(grad_sq) if nonfinite == 0 and math.isfinite(grad_sq) else float("nan")
    decision = None
    for h in hooks:
        decision = h.decide(StepSignals(inp.step, loss, grad_norm)) if decision is None else decision
    applied = decision is None or bool(decision.apply)
    module.settle()  # a checkpoint still copying the state it saved finishes before the update changes it
    for h in hooks:
        h.before_update(module)
    with update_suppressed(engine, not applied):
        engine.step()  # the boundary: clip, update (or not), zero the gradients
    if applied and moe:
        update_balance_biases(engine.module, moe)  # from the all-reduced load: the same update on every rank
    for h in hooks:
        h.after_update(module)
    return StepResult(loss, grad_norm, applied, decision, moe)


def token_weights(labels: torch.Tensor, plan, causal: bool, device: torch.device) -> torch.Tensor:
    """(this rank's real micro-batches,) fp32 on ``device``: each micro-batch's number of targets (``labels`` of this
    rank's share) over the mean number per real micro-batch of the whole step, every data-parallel rank's counted
    (0 for all without any target). Weighting each micro-batch's mean cross-entropy by it makes the mean over the
    step's micro-batches (what DeepSpeed's gradient accumulation and data-parallel averaging form) the token mean
    over the step's targets, whatever the micro-batch size and the worker count; exactly 1 where every micro-batch
    has as many targets (decoders' full labels). The counts are summed over all workers (one all-reduce, no host
    read): the model-parallel ranks of one data-parallel rank count the same targets, which the mean divides out."""
    keep = targets(labels, causal) != IGNORE  # (share, T')
    counts = torch.stack([keep[i : i + plan.micro_batch].sum() for i in range(0, keep.shape[0], plan.micro_batch)])
    counts = counts.to(device, torch.float64)
    total = counts.sum().view(1)
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    # integers in float64: the one rounding is the division's, so equal counts give exactly 1
    return (counts * float(plan.real_micro_batches * plan.model_parallel) / total.clamp(min=1.0)).float()


def _loss_sum(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The micro-batches' fp32 losses added in order in float64 on the device (the sum a host would form from
    their values, bit for bit, without reading each)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for x in losses:
        total = total + x.double()
    return total


def read_signals(signals: torch.Tensor, model, device: torch.device) -> tuple[list[float], dict[int, torch.Tensor]]:
    """``signals`` (reduced float64 on the device) as floats, and every MoE layer's accumulated routing statistics
    summed over ranks (one all-reduce; fp32 host tensors by block index), read by the host in one copy."""
    layers = moe_layers(model)
    if not layers:
        return signals.tolist(), {}
    rows = [layer.take_stats().to(device) for _, layer in layers]
    flat = torch.cat(rows)
    torch.distributed.all_reduce(flat)
    host = torch.cat([signals, flat.double()]).cpu()  # fp32 -> fp64 -> fp32: exact
    n = signals.numel()
    parts = host[n:].float().split([r.numel() for r in rows])
    return host[:n].tolist(), {i: part for (i, _), part in zip(layers, parts)}


@contextmanager
def update_suppressed(engine, suppress: bool):
    """Run ``engine.step()`` without an update: the wrapped torch optimizer's ``step`` is a no-op.

    DeepSpeed keeps all its bookkeeping (micro-step counter, gradient clearing, ZeRO buffers, fp32 ->
    model copy of unchanged master weights), while the weights and the optimizer state stay bitwise
    unchanged — for every ZeRO stage, without reaching into each stage's gradient buffers."""
    if not suppress:
        yield
        return
    opt = ds_adapter.base_optimizer(engine.optimizer)
    wrapper = engine.optimizer
    # ZeRO-1/2 link optimizer-state fragments once, after the first step; a skipped first step must
    # not link them to the still-empty state.
    linked = ds_adapter.hp_states_linked(wrapper)
    # an instance attribute shadows the method (deliberate)
    opt.step = lambda *args, **kwargs: None  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        del opt.step
        if linked is False:
            ds_adapter.unlink_hp_optimizer_states(wrapper)


@torch.no_grad()
def evaluate(
    module, batches: list[dict[str, torch.Tensor]], byte_lengths: torch.Tensor | None = None, prefix: str = "val/"
) -> dict[str, float]:
    """``val/loss``, ``val/ppl`` (and ``val/mlm_acc`` for encoders; ``val/bits_per_byte`` for decoders given the UTF-8
    ``byte_lengths`` of every token id) of the one scorer (``pretrain/model/score.py``) over all ranks' shares. Every
    rank runs as many forwards as the rank with the most batches (ZeRO-3 and expert-parallel forwards are collective):
    the others pad with batches without targets. Collective."""
    engine, device, kind = module.engine, module.device, module.cfg.model.kind
    forwards = int(-dist.all_reduce_min([-float(len(batches))], device)[0])
    if batches:
        batches = batches + [_padding(batches[0])] * (forwards - len(batches))
    engine.eval()
    try:
        sums = score_batches(
            lambda ids, labels: engine(ids, labels=labels).logits,
            batches,
            kind,
            byte_lengths=byte_lengths,
            device=device,
        )
    finally:
        engine.train()
    plan = getattr(module, "plan", None)
    if plan is not None and not plan.shares_data(module.rank):
        sums = ScoreSums()  # the first of the ranks that score the same sequences counts them
    sums = ScoreSums.from_list(dist.all_reduce_sum(sums.as_list(), device))
    metrics = sums.metrics(kind, with_bytes=byte_lengths is not None, allow_empty=True)
    return {f"{prefix}{k}": v for k, v in metrics.items()}
