"""Model growth inside a running job: a callback that, at each ``growth.schedule`` entry, gathers the full weights,
grows them (pure operators in ``pretrain/model/growth.py``), rebuilds the TrainModule on the grown model
(DeepSpeed re-initialized, same process, same data stream), and checks the function on a held-back batch."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pretrain.config import RunConfig
from pretrain.model.growth import apply_growth, count_parameters
from pretrain.train.callbacks import StabilityCallback
from pretrain.train.optimizer_state import MOMENTS, gather_moments, load_moments
from pretrain.train.step import evaluate
from pretrain.train.trainer import Callback, Trainer


class GrowthCheckError(RuntimeError):
    """A function-preserving growth changed the model's loss: a bug, never trained on."""


def grown_config(cfg: RunConfig, model, moe) -> RunConfig:
    """``cfg`` with the grown architecture (expert parallelism kept when the new expert count allows it)."""
    if moe.enabled and moe.num_experts % cfg.moe.ep_size:
        moe = dataclasses.replace(moe, ep_size=1)
    return dataclasses.replace(cfg, model=model, moe=moe).validate()


class GrowthCallback(Callback):
    """Grows before the first step after each entry's ``at_step``, so an uninterrupted run and one resumed from the
    checkpoint of that step grow at the same point. Applied entries are remembered in the checkpoint."""

    order = 3
    name = "growth"

    def __init__(self, cfg: RunConfig) -> None:
        self.schedule = cfg.growth.schedule
        self.rewarm = cfg.growth.rewarm_steps
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
        probe = trainer.val_set[:1]
        before = evaluate(module, probe)["val/loss"] if probe else float("nan")
        full = module.full_state_dict()
        seed = cfg.train.seed + entry.at_step
        grown = apply_growth(cfg.model, cfg.moe, full, entry, seed=seed)
        moments = gather_moments(module) if self.keep_optimizer else None
        new_cfg = grown_config(cfg, grown.model, grown.moe)
        module.rebuild(new_cfg, grown.state)
        if moments and moments["step"]:  # the same operator on the moments (no noise)
            exact = dataclasses.replace(entry, noise=0.0)
            load_moments(module, {"step": moments["step"], **{
                k: apply_growth(cfg.model, cfg.moe, moments[k], exact, seed=seed).state for k in MOMENTS}})
        trainer.cfg = new_cfg
        stability = trainer.find(StabilityCallback)
        if stability is not None:  # no rollback across a growth; spike statistics of the new model only
            stability.monitor.restart()
        after = evaluate(module, probe)["val/loss"] if probe else float("nan")
        self.applied.append(index)
        self.last_growth_step = entry.at_step
        rel = abs(after - before) / max(abs(before), 1e-12)
        params = count_parameters(grown.state, grown.model.tie_embeddings)
        trainer.progress.say(f"growth at step {entry.at_step}: {grown.operator}; held-back loss {before:.5f} -> "
                             f"{after:.5f} (rel. change {rel:.1e}); {params:,} parameters")
        trainer.tracker.log_metrics({"growth/loss_before": before, "growth/loss_after": after,
                                     "growth/parameters": float(params)}, entry.at_step)
        trainer.tracker.set_tags({f"growth.{index}.operator": grown.operator, f"growth.{index}.at_step": entry.at_step})
        if grown.exact and entry.noise == 0 and math.isfinite(before) and rel > self.tolerance:
            raise GrowthCheckError(f"growth at step {entry.at_step} ({grown.operator}) should preserve the function but "
                                   f"changed the held-back loss {before:.6f} -> {after:.6f} (relative {rel:.2e} > "
                                   f"growth.check_tolerance {self.tolerance:g})")
