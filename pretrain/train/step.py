"""The step: one optimizer update over this rank's share of the global batch, and evaluation.

Everything that changes the math of an update (LR, micro-batching, z-loss, clipping via DeepSpeed, loss
averaging across ranks, the stability guard that may drop the update) lives here; the loop around it
only schedules and observes.
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pretrain.model.moe import moe_layers
from pretrain.train import dist
from pretrain.train.engine import set_lr
from pretrain.train.health import HealthProbe, grad_signals
from pretrain.train.stability import StepSignals


def step_seed(seed: int, step: int, index: int) -> int:
    """Seed of the global torch RNG (dropout) for one step and one rank or micro-batch id: resume needs
    no RNG replay, and with micro-batch ids the masks do not depend on the worker count."""
    return zlib.crc32(f"{seed}:{step}:{index}".encode()) & 0x7FFFFFFF


def micro_batch_ids(rank: int, world_size: int, global_batch: int, micro: int, num_streams: int) -> list[int]:
    """Global ids of this rank's micro-batches in one step, independent of the worker count.

    Rank r holds, in order, the G/S sequences of each stream s = r, r+W, r+2W, ...; when the micro-batch
    divides G/S each micro-batch lies in one stream, and its id is (stream, offset) flattened — the same
    id whichever worker holds it. Otherwise ids fall back to rank order (still deterministic)."""
    per_rank = global_batch // world_size // micro
    per_stream_seqs = global_batch // num_streams
    if per_stream_seqs % micro:
        return [rank * per_rank + j for j in range(per_rank)]
    per_stream = per_stream_seqs // micro
    return [(rank + (j // per_stream) * world_size) * per_stream + j % per_stream for j in range(per_rank)]


def _micro_batches(batch: dict[str, torch.Tensor], micro: int, device: torch.device):
    n = batch["input_ids"].shape[0]
    for i in range(0, n, micro):
        yield {k: v[i:i + micro].to(device, non_blocking=True) for k, v in batch.items()}


class Guard(Protocol):
    """Decides, from the reduced signals of a step, whether its update is applied."""

    def __call__(self, signals: StepSignals) -> Any: ...  # returns an object with a bool ``apply``


@dataclass
class StepResult:
    loss: float
    """Mean loss over all ranks and micro-batches (the cross-entropy, without the z-loss term)."""
    grad_norm: float
    """Global pre-clipping gradient norm (same on every rank)."""
    applied: bool = True
    """Whether the optimizer update was applied (False when the guard skipped it)."""
    decision: Any = None
    """What the guard returned."""
    health: dict[str, float] = field(default_factory=dict)
    """Health metrics (only when a probe was given)."""
    moe: dict[int, torch.Tensor] = field(default_factory=dict)
    """Routing statistics of this step summed over all ranks and micro-batches, per MoE block index
    (see :func:`pretrain.model.moe.routing_metrics`); empty for dense models."""


def train_step(engine, batch: dict[str, torch.Tensor], micro: int, lr: float,
               device: torch.device, seeds: list[int] | None = None) -> tuple[float, float]:
    """One optimizer step over this rank's share of the global batch -> (global mean loss, grad norm).
    ``seeds``: per micro-batch seed of the global torch RNG (dropout), see ``micro_batch_ids``."""
    result = run_step(engine, batch, micro, lr, device, seeds)
    return result.loss, result.grad_norm


def run_step(engine, batch: dict[str, torch.Tensor], micro: int, lr: float, device: torch.device,
             seeds: list[int] | None = None, *, step: int = 0, guard: Guard | None = None,
             probe: HealthProbe | None = None, corrupt_grads: bool = False) -> StepResult:
    """One optimizer step, with the stability hooks:

    * at the accumulation boundary, after the last backward and *before* ``engine.step()``, the loss,
      the squared gradient norm (from this rank's shard) and a non-finite flag are all-reduced in one
      collective, and ``guard`` (same inputs on every rank) decides whether the update is applied;
      a skipped update leaves weights and optimizer state bitwise unchanged (:func:`update_suppressed`);
    * ``probe`` (health steps) observes the first micro-batch's forward and the update;
    * ``corrupt_grads`` (fault injection) turns this rank's gradients NaN, the loss staying finite.
    ``step``: the 1-based number of this step, passed to the guard."""
    set_lr(engine, lr)
    losses = []
    mbs = list(_micro_batches(batch, micro, device))
    for i, mb in enumerate(mbs):
        if seeds is not None:
            torch.manual_seed(seeds[i])
        if probe is not None and i == 0:
            probe.attach()
        out = engine(mb["input_ids"], labels=mb["labels"])
        if probe is not None and i == 0:
            probe.detach(out)
        objective = out.objective()
        if corrupt_grads and i == len(mbs) - 1:
            objective = _NaNGrad.apply(objective)
        engine.backward(objective)
        losses.append(out.loss.detach().float().item())
        if i < len(mbs) - 1:
            engine.step()  # not a boundary: DeepSpeed only counts the micro-step
    grad_sq, nonfinite = grad_signals(engine)
    loss_sum, grad_sq, nonfinite = dist.all_reduce_sum([sum(losses) / len(losses), grad_sq, nonfinite], device)
    loss = loss_sum / torch.distributed.get_world_size()
    grad_norm = math.sqrt(grad_sq) if nonfinite == 0 and math.isfinite(grad_sq) else float("nan")
    moe = reduce_moe_stats(engine.module, device)
    decision = guard(StepSignals(step, loss, grad_norm)) if guard is not None else None
    applied = decision is None or bool(decision.apply)
    if probe is not None:
        probe.before_update()
    with update_suppressed(engine, not applied):
        engine.step()  # the boundary: clip, update (or not), zero the gradients
    health = {}
    if probe is not None:
        probe.after_update()
        health = probe.reduce(device)
    return StepResult(loss, grad_norm, applied, decision, health, moe)


def reduce_moe_stats(model, device: torch.device) -> dict[int, torch.Tensor]:
    """Take every MoE layer's accumulated routing statistics and sum them over ranks (one all-reduce)."""
    layers = moe_layers(model)
    if not layers:
        return {}
    rows = [layer.take_stats().to(device) for _, layer in layers]
    flat = torch.cat(rows)
    torch.distributed.all_reduce(flat)
    return {i: part.cpu() for (i, _), part in zip(layers, flat.split([r.numel() for r in rows]))}


class _NaNGrad(torch.autograd.Function):
    """Identity forward, NaN backward: fault injection that poisons this rank's gradients only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))


def _base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO, BF16_Optimizer), which all call its step."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


@contextmanager
def update_suppressed(engine, suppress: bool):
    """Run ``engine.step()`` without an update: the wrapped torch optimizer's ``step`` is a no-op.

    DeepSpeed keeps all its bookkeeping (micro-step counter, gradient clearing, ZeRO buffers, fp32 ->
    model copy of unchanged master weights), while the weights and the optimizer state stay bitwise
    unchanged — for every ZeRO stage, without reaching into each stage's gradient buffers."""
    if not suppress:
        yield
        return
    opt = _base_optimizer(engine.optimizer)
    wrapper = engine.optimizer
    # ZeRO-1/2 link optimizer-state fragments once, after the first step; a skipped first step must
    # not link them to the still-empty state.
    linked = getattr(wrapper, "_hp_optimizer_states_linked", None)
    opt.step = lambda *args, **kwargs: None  # an instance attribute shadows the method
    try:
        yield
    finally:
        del opt.step
        if linked is False:
            wrapper._hp_optimizer_states_linked = False


@torch.no_grad()
def evaluate(engine, batches: list[dict[str, torch.Tensor]], kind: str, device: torch.device) -> dict[str, float]:
    """Token-weighted validation loss (and MLM accuracy for encoders) over all ranks' shares."""
    engine.eval()
    loss_sum = count = correct = 0.0
    for mb in batches:
        mb = {k: v.to(device) for k, v in mb.items()}
        out = engine(mb["input_ids"], labels=mb["labels"])
        labels = mb["labels"][:, 1:] if kind == "decoder" else mb["labels"]
        n = float((labels != -100).sum())
        loss_sum += out.loss.float().item() * n
        count += n
        if kind == "encoder":
            pred = out.logits.argmax(-1)
            correct += float(((pred == labels) & (labels != -100)).sum())
    engine.train()
    loss_sum, count, correct = dist.all_reduce_sum([loss_sum, count, correct], device)
    loss = loss_sum / max(count, 1.0)
    metrics = {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}
    if kind == "encoder":
        metrics["val/mlm_acc"] = correct / max(count, 1.0)
    return metrics
