"""AdamW's moments as full tensors by parameter name, gathered from (and put back into) a DeepSpeed engine of any
ZeRO stage — what growth transforms when ``growth.optimizer: grow`` keeps the optimizer state.

``gather_moments(module)`` -> ``{"step": n, "exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}}`` (every rank,
collective); ``load_moments(module, moments)`` sets them (for the module's own shapes) and the step count. Uses
DeepSpeed's ``safe_get/set_full_optimizer_state`` (ZeRO-1/2/3) or the torch optimizer's state (stage 0). Not under
expert parallelism (an expert's moments live on its expert-parallel ranks only).
"""

from __future__ import annotations

from typing import Any

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def _base(module) -> torch.optim.Optimizer:
    from pretrain.train.step import _base_optimizer

    return _base_optimizer(module.engine.optimizer)


def _link_all_groups(module) -> None:
    """DeepSpeed ZeRO-1/2 link each parameter to its optimizer-state fragment right after the first optimizer step of
    the *first* parameter group, before the other groups have state: their fragments stay empty (no ``exp_avg``).
    Link again now that every group has state."""
    opt = module.engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state") and _base(module).state:
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _check(module) -> None:
    if any(getattr(p, "allreduce", True) is False for p in module.model.parameters()):
        raise ValueError("growth.optimizer grow: not with expert parallelism (moe.ep_size > 1); use reset")


def gather_moments(module) -> dict[str, Any]:
    """The full moments and the step count; empty moment dicts before the first step. Collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    _check(module)
    base = _base(module)
    steps = [float(v["step"]) for v in base.state.values() if "step" in v]
    out: dict[str, Any] = {"step": int(max(steps)) if steps else 0, **{k: {} for k in MOMENTS}}
    if not steps:
        return out
    _link_all_groups(module)
    for name, p in module.model.named_parameters():
        shape = tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)
        for key in MOMENTS:
            value = base.state[p][key] if module.zero_stage == 0 else safe_get_full_optimizer_state(p, key)
            out[key][name] = value.detach().float().cpu().clone().reshape(shape)
    return out


def load_moments(module, moments: dict[str, Any]) -> None:
    """Set the moments (full tensors of this module's shapes) and the step count. A fresh optimizer has no state yet:
    one step with zero gradients at LR 0 creates it without moving a weight (AdamW: zero moments, a zero update,
    weight decay scaled by the LR). Collective."""
    from deepspeed.utils import safe_set_full_optimizer_state

    from pretrain.train.step import StepInput, run_step

    if not moments.get("step"):
        return
    _check(module)
    base = _base(module)
    if not base.state:
        ids = torch.zeros(module.plan.shares[module.rank], module.cfg.model.max_seq_len, dtype=torch.long)
        run_step(module, StepInput(0, {"input_ids": ids, "labels": torch.full_like(ids, -100)}, 0.0))
    _link_all_groups(module)
    for name, p in module.model.named_parameters():
        for key in MOMENTS:
            value = moments[key][name].to(module.device, torch.float32)
            if module.zero_stage == 0:
                base.state[p][key].copy_(value.view_as(base.state[p][key]))
            else:
                safe_set_full_optimizer_state(p, value.flatten() if hasattr(p, "ds_id") else value, key)
    for state in base.state.values():
        if "step" in state:
            state["step"] = (torch.tensor(float(moments["step"])) if torch.is_tensor(state["step"])
                             else moments["step"])
