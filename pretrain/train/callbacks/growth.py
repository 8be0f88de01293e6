"""Model growth inside a running job: a callback that, at each ``growth.schedule`` entry, gathers the full weights,
grows them (pure operators in ``pretrain/model/growth.py``), checks the function on a held-back batch in fp32, and
rebuilds the TrainModule on the grown model (DeepSpeed re-initialized, same process, same data stream)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any

import torch

from pretrain.config import RunConfig
from pretrain.model import build_model
from pretrain.model.growth import StateDict, apply_growth, count_parameters
from pretrain.model.growth_moments import grow_moments
from pretrain.model.layerdrop import as_of, inference_scales
from pretrain.model.score import ScoreSums, score_batches
from pretrain.train import dist
from pretrain.train.callbacks.base import Callback
from pretrain.train.engine import resolve_precision
from pretrain.train.optimizer_state import gather_moments, load_moments
from pretrain.train.step import evaluate
from pretrain.train.trainer import Trainer

REBUILT_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}
"""How far (relative) the rebuilt engine's held-back loss may be from the grown weights' fp32 loss: the same
weights, computed by the engine (its precision, its parallel layout) instead of a plain fp32 model."""


class GrowthCheckError(RuntimeError):
    """A function-preserving growth changed the model's loss: a bug, never trained on."""


def check_growth_loss(
    before: float, after: float, *, exact: bool, tolerance: float, operator: str, at_step: int
) -> float:
    """The relative change of the held-back loss; raises :class:`GrowthCheckError` when ``exact`` (a
    function-preserving operator applied without noise) and the change is above ``tolerance`` or not a number."""
    rel = abs(after - before) / max(abs(before), 1e-12)
    if exact and not rel <= tolerance:  # NaN fails too
        raise GrowthCheckError(
            f"growth at step {at_step} ({operator}) should preserve the function but changed the "
            f"held-back loss (fp32) {before:.6f} -> {after:.6f} (relative {rel:.2e} > "
            f"growth.check_tolerance {tolerance:g})"
        )
    return rel


@contextmanager
def _fp32_math(device: torch.device):
    """No autocast and no TF32 matmuls: an fp32 forward computed in fp32."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _local_sums(
    cfg: RunConfig, state: StateDict, batches: list[dict[str, torch.Tensor]], device: torch.device
) -> ScoreSums:
    """The scorer's sums of a plain fp32 model ``cfg.model`` holding ``state`` (a full state dict) on ``batches``,
    in eval mode on ``device``; no collectives."""
    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    model = build_model(cfg.model, 0, cfg.moe, weights=fp32).to(device)
    model.branch_scales = inference_scales(cfg.layer_drop, cfg.model.num_layers)
    model.eval()
    with _fp32_math(device):
        return score_batches(
            lambda ids, labels: model(ids, labels=labels).logits, batches, cfg.model.kind, device=device
        )


def held_back_loss(
    cfg: RunConfig, state: StateDict, batches: list[dict[str, torch.Tensor]], device: torch.device
) -> float:
    """Token-weighted loss (the one scorer, ``pretrain/model/score.py``) of ``state`` in fp32 (whatever
    ``train.precision`` is) over every rank's ``batches`` (a rank may have none). Collective (one all-reduce), so
    every rank gets the same value and decision; computed on ``device``, or on the CPU where a full fp32 copy of
    the model does not fit there."""
    try:
        local = _local_sums(cfg, state, batches, device) if batches else ScoreSums()
    except torch.cuda.OutOfMemoryError:  # a full fp32 copy next to the engine: use host memory
        torch.cuda.empty_cache()
        local = _local_sums(cfg, state, batches, torch.device("cpu"))
    sums = ScoreSums.from_list(dist.all_reduce_sum(local.as_list(), device))
    if sums.tokens == 0:
        raise GrowthCheckError(
            "growth: no held-back validation tokens to check the growth on (train.val_sequences, "
            "data.val_holdout / data.val_sources)"
        )
    return sums.metrics(cfg.model.kind)["loss"]


def rebuilt_loss(module, batches: list[dict[str, torch.Tensor]], cfg: RunConfig) -> float:
    """The held-back loss of ``batches`` through the rebuilt engine itself (collective): its eval forward with the
    inference scales of ``cfg``'s layer dropout, as validation computes it."""
    model = module.model
    kept = model.branch_scales
    model.branch_scales = inference_scales(cfg.layer_drop, cfg.model.num_layers)
    try:
        return evaluate(module, batches)["val/loss"]
    finally:
        model.branch_scales = kept


def check_rebuilt(after: float, rebuilt: float, precision: str, at_step: int) -> None:
    """Raise :class:`GrowthCheckError` when the rebuilt engine does not compute what the grown weights do: its
    rebuild did not load them (a parameter left at its initialization, a partition of another tensor)."""
    rel = abs(rebuilt - after) / max(abs(after), 1e-12)
    if not rel <= REBUILT_TOLERANCE.get(precision, REBUILT_TOLERANCE["bf16"]):  # NaN fails too
        raise GrowthCheckError(
            f"growth at step {at_step}: the rebuilt engine's held-back loss {rebuilt:.6f} is not the grown "
            f"weights' {after:.6f} (relative {rel:.2e}, {precision}): the engine did not load the grown model"
        )


def grown_config(cfg: RunConfig, model, moe) -> RunConfig:
    """``cfg`` with the grown architecture (expert parallelism kept when the new expert count allows it)."""
    parallel = cfg.parallel
    if moe.enabled and moe.num_experts % parallel.expert:
        parallel = dataclasses.replace(parallel, expert=1)
    return dataclasses.replace(cfg, model=model, moe=moe, parallel=parallel).validate()


class GrowthCallback(Callback):
    """Grows before the first step after each entry's ``at_step``, so an uninterrupted run and one resumed from the
    checkpoint of that step grow at the same point. Applied entries are remembered in the checkpoint, with the step
    of the last growth, from which the LR re-warms (also after an offline ``grow``: its checkpoint records it)."""

    order = 3
    name = "growth"

    def __init__(self, cfg: RunConfig) -> None:
        self.schedule = cfg.growth.schedule
        self.rewarm = cfg.growth.rewarm(cfg.train.warmup_steps)
        self.tolerance = cfg.growth.check_tolerance
        self.keep_optimizer = cfg.growth.optimizer == "grow"
        self.applied: list[int] = []
        self.last_growth_step = -1
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"applied": self.applied, "last_growth_step": self.last_growth_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.applied = list(state.get("applied", []))
        self.last_growth_step = int(state.get("last_growth_step", -1))

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        self.step = step
        for i, entry in enumerate(self.schedule):
            if i not in self.applied and entry.at_step == step - 1:
                self.grow(trainer, i, entry)

    def lr_factor(self, step: int) -> float:
        if self.rewarm and self.last_growth_step >= 0 and step - self.last_growth_step <= self.rewarm:
            return (step - self.last_growth_step) / self.rewarm
        return 1.0

    def grow(self, trainer: Trainer, index: int, entry) -> None:
        module, cfg = trainer.module, trainer.module.cfg
        probe = trainer.val_set[:1]  # this rank's first held-back micro-batch (the check reduces over ranks)
        full = module.full_state_dict()  # fp32 (the masters under bf16)
        trained = as_of(cfg.layer_drop, entry.at_step - 1)  # the layer dropout of the steps trained so far
        before = held_back_loss(dataclasses.replace(cfg, layer_drop=trained), full, probe, module.device)
        seed = cfg.train.seed + entry.at_step
        grown = apply_growth(cfg.model, cfg.moe, full, entry, seed=seed, layer_drop=trained)
        moments = gather_moments(module) if self.keep_optimizer else None
        new_cfg = grown_config(cfg, grown.model, grown.moe)
        after = held_back_loss(dataclasses.replace(new_cfg, layer_drop=trained), grown.state, probe, module.device)
        rel = abs(after - before) / max(abs(before), 1e-12)
        params = count_parameters(grown.state, grown.model.tie_embeddings)
        trainer.progress.say(
            f"growth at step {entry.at_step}: {grown.operator}; held-back loss (fp32) {before:.5f} -> "
            f"{after:.5f} (rel. change {rel:.1e}); {params:,} parameters"
        )
        trainer.tracker.log_metrics(
            {"growth/loss_before": before, "growth/loss_after": after, "growth/parameters": float(params)},
            entry.at_step,
        )
        trainer.tracker.set_tags({f"growth.{index}.operator": grown.operator, f"growth.{index}.at_step": entry.at_step})
        check_growth_loss(
            before,
            after,
            exact=grown.exact and entry.noise == 0,
            tolerance=self.tolerance,
            operator=grown.operator,
            at_step=entry.at_step,
        )
        module.rebuild(new_cfg, grown.state)
        if moments and moments["step"]:  # transformed like the grown model's gradients (model/growth_moments.py)
            load_moments(
                module,
                {"step": moments["step"], **grow_moments(cfg.model, cfg.moe, moments, entry, seed, trained)},
            )
        rebuilt = rebuilt_loss(module, probe, dataclasses.replace(new_cfg, layer_drop=trained))
        trainer.tracker.log_metrics({"growth/loss_rebuilt": rebuilt}, entry.at_step)
        check_rebuilt(after, rebuilt, resolve_precision(cfg.train.precision, module.device), entry.at_step)
        trainer.cfg = new_cfg
        trainer.emit("on_model_changed")
        self.applied.append(index)
        self.last_growth_step = entry.at_step
