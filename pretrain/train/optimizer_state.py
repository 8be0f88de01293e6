"""AdamW's moments as full tensors by parameter name, gathered from (and put back into) a DeepSpeed engine of any
ZeRO stage — what growth transforms when ``growth.optimizer: grow`` keeps the optimizer state.

``gather_moments(module)`` -> ``{"step": n, "exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}}`` (every rank,
collective); ``load_moments(module, moments)`` sets them (for the module's own shapes) and the step count. Uses
DeepSpeed's ``safe_get/set_full_optimizer_state`` (ZeRO-1/2/3, through :mod:`pretrain.ds_adapter`) or the torch
optimizer's state (stage 0). ``gather_moments`` is not for expert parallelism (an expert's moments live on its
expert-parallel ranks only); ``load_moments`` is: each rank sets the moments of the experts it holds (by their
global names), which is how a checkpoint resumes on another expert layout.
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain import ds_adapter
from pretrain.model.moe import routing_state_kept
from pretrain.parallel.expert import global_param_names
from pretrain.parallel.tensor import gather_shards, local_shards

MOMENTS = ("exp_avg", "exp_avg_sq")


def _base(module) -> torch.optim.Optimizer:
    return ds_adapter.base_optimizer(module.engine.optimizer)


def _link_all_groups(module) -> None:
    """DeepSpeed ZeRO-1/2 link the optimizer-state fragments before every parameter group has state: link again
    now that every group has state (see :func:`pretrain.ds_adapter.relink_hp_optimizer_states`)."""
    if _base(module).state:
        ds_adapter.relink_hp_optimizer_states(module.engine.optimizer)


def _check(module) -> None:
    if any(ds_adapter.is_expert_param(p) for p in module.model.parameters()):
        raise ValueError("growth.optimizer grow: not with expert parallelism (moe.ep_size > 1); use reset")


def gather_moments(module) -> dict[str, Any]:
    """The full moments and the step count; empty moment dicts before the first step. Collective."""
    _check(module)
    base = _base(module)
    steps = [float(v["step"]) for v in base.state.values() if "step" in v]
    out: dict[str, Any] = {"step": int(max(steps)) if steps else 0, **{k: {} for k in MOMENTS}}
    if not steps:
        return out
    _link_all_groups(module)
    masters = ds_adapter.unfused_fp32_masters(module.engine)
    for name, p in module.model.named_parameters():
        shape = ds_adapter.full_shape(p)
        for key in MOMENTS:
            value = (
                _stage0_state(base, masters, p)[key]
                if module.zero_stage == 0
                else ds_adapter.full_optimizer_state(p, key)
            )
            out[key][name] = value.detach().float().cpu().clone().reshape(shape)
    for key in MOMENTS:  # tensor parallelism: whole tensors from the AutoTP shards
        out[key] = gather_shards(module.model, out[key])
    return out


def _stage0_state(base, masters: dict[int, torch.Tensor], p: torch.Tensor) -> dict:
    """The ZeRO-0 optimizer's state of module parameter ``p``: kept on its fp32 master under bf16/fp16 (DeepSpeed's
    unfused wrapper steps the inner optimizer on fp32 copies, ``masters`` by ``id``), else on ``p`` itself."""
    return base.state[masters.get(id(p), p)]


def _create_state(module) -> None:
    """Give a fresh optimizer its state: one step with zero gradients at LR 0, which moves no weight (AdamW: zero
    moments, a zero update, weight decay scaled by the LR) and leaves the MoE selection biases and routing
    statistics as they were (the step's routing counts neither move the biases nor reach the metrics). Collective."""
    from pretrain.train.step import StepInput, run_step

    ids = torch.zeros(module.plan.share(module.rank), module.cfg.model.max_seq_len, dtype=torch.long)
    with routing_state_kept(module.model):
        run_step(module, StepInput(0, {"input_ids": ids, "labels": torch.full_like(ids, -100)}, 0.0))


def load_moments(module, moments: dict[str, Any]) -> None:
    """Set the moments (full tensors by full-state-dict name: experts under global ids) and the step count; under
    expert parallelism each rank takes those of its own experts. A fresh optimizer has no state yet: see
    :func:`_create_state`. Collective."""
    if not moments.get("step"):
        return
    base = _base(module)
    if not base.state:
        _create_state(module)
    _link_all_groups(module)
    names = global_param_names(module.model)
    local = {key: local_shards(module.model, moments[key]) for key in MOMENTS}  # tensor parallelism: this rank's
    masters = ds_adapter.unfused_fp32_masters(module.engine)
    for name, p in module.model.named_parameters():
        for key in MOMENTS:
            value = local[key][names.get(name, name)].to(module.device, torch.float32)
            if module.zero_stage == 0:
                state = _stage0_state(base, masters, p)
                state[key].copy_(value.view_as(state[key]))
            else:
                ds_adapter.set_full_optimizer_state(p, value, key)
    for state in base.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(moments["step"])) if torch.is_tensor(state["step"]) else moments["step"]
