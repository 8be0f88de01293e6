"""ZeRO's parameters, gradients and optimizer wrappers: where DeepSpeed keeps this rank's partitions, the torch
optimizer inside its wrappers, and the full optimizer state of a parameter (through :mod:`pretrain.ds_adapter`)."""

from __future__ import annotations

import torch

Views = list[tuple[torch.nn.Parameter, torch.Tensor]]


# -- parameters (ZeRO-3 partitioning) -----------------------------------------------------------------------------


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter (its data is this rank's partition, gathered by DeepSpeed's module
    hooks when its own module runs). 0.19: ``deepspeed.initialize`` under stage 3 converts every module parameter
    (``zero.Init``'s ``_convert_to_deepspeed_param``), which gives it ``ds_id`` — persistent small ones too."""
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The parameter's full shape: ``ds_shape`` for a ZeRO-3 parameter (its ``shape`` is the empty placeholder
    between gathers, 0.19), else its shape."""
    return tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)


def local_param_views(engine) -> tuple[Views, bool]:
    """(parameter, the values this rank holds) of every module parameter, and whether they are replicated (the full
    tensor on every rank). ZeRO-3: this rank's flat partition ``p.ds_tensor`` (0.19), not replicated."""
    params = list(engine.module.parameters())
    if params and hasattr(params[0], "ds_tensor"):
        return [(p, p.ds_tensor) for p in params], False
    return [(p, p.detach()) for p in params], True


# -- gradients at the accumulation boundary (before engine.step()) ------------------------------------------------


def grad_views(engine) -> tuple[Views, bool]:
    """(parameter, gradient) pairs of this rank, and whether they are replicated (every rank holds the same full
    gradients, so a cross-rank sum must count each once). Where 0.19 keeps them after the last backward:

    * ZeRO-1/2: this rank's partition in ``optimizer.averaged_gradients[group]`` (a dict), aligned with
      ``optimizer.params_in_partition[group]``; padding tensors carry ``_zero_padding``;
    * ZeRO-3: ``optimizer.averaged_gradients[group]`` holds this rank's partition of each parameter of
      ``optimizer.fp16_groups[group]``;
    * bf16 ZeRO-1 with fp32 gradient accumulation (``BF16_Optimizer``): full fp32 gradients in
      ``fp32_groups_gradients`` beside ``bf16_groups`` (replicated);
    * stage 0 fp32: full averaged gradients on ``p.grad`` (replicated);
    * offloaded optimizer states: ``deepspeed.utils.safe_get_full_grad`` per parameter (public, collective;
      replicated)."""
    opt = engine.optimizer
    groups = getattr(opt, "averaged_gradients", None)
    if groups is not None and hasattr(opt, "params_in_partition") and not getattr(opt, "cpu_offload", False):
        views: Views = []
        for i, params in enumerate(opt.params_in_partition):  # ZeRO-1/2
            grads = [g for g in (groups.get(i) or []) if not getattr(g, "_zero_padding", False)]
            views += zip(params, grads)
        return views, False
    if groups is not None and hasattr(opt, "fp16_groups") and not getattr(opt, "offload_optimizer", False):
        return zero3_grad_partitions(opt), False
    if hasattr(opt, "fp32_groups_gradients") and hasattr(opt, "bf16_groups"):  # bf16 ZeRO-1
        return [(p, g) for ps, gs in zip(opt.bf16_groups, opt.fp32_groups_gradients) for p, g in zip(ps, gs)], True
    if engine.zero_optimization_stage() == 0:
        return [(p, p.grad) for p in engine.module.parameters() if p.grad is not None], True
    from deepspeed.utils import safe_get_full_grad

    full = [(p, safe_get_full_grad(p)) for p in engine.module.parameters() if p.requires_grad]
    return [(p, g) for p, g in full if g is not None], True


def zero3_grad_partitions(optimizer) -> Views:
    """ZeRO-3: (parameter, this rank's gradient partition) per parameter, from ``optimizer.fp16_groups[group]`` and
    ``optimizer.averaged_gradients[group]`` (0.19). The partitions are the buffers ``engine.step()`` reads: zeroing
    one zeroes that gradient. 0.19 keeps a parameter's partition from the last step in which it had a gradient."""
    views: Views = []
    for i, params in enumerate(optimizer.fp16_groups):
        views += zip(params, optimizer.averaged_gradients.get(i) or [])
    return views


# -- optimizers -----------------------------------------------------------------------------------------------------


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO stages, ``BF16_Optimizer``, ``FP16_UnfusedOptimizer``):
    each keeps the optimizer it was given in ``.optimizer`` and calls its ``step`` (0.19)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def unfused_fp32_masters(engine) -> dict[int, torch.Tensor]:
    """ZeRO-0 bf16 (0.19's ``FP16_UnfusedOptimizer``: ``fp16_groups`` / ``fp32_groups``, no ``params_in_partition``):
    the fp32 master of each module parameter, by ``id``; empty for the other optimizers, whose masters
    ``deepspeed.utils.safe_{get,set}_full_fp32_param`` reach."""
    opt = engine.optimizer
    if (
        not (hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"))
        or hasattr(opt, "params_in_partition")
        or engine.zero_optimization_stage() != 0
    ):
        return {}
    return {id(p16): p32 for g16, g32 in zip(opt.fp16_groups, opt.fp32_groups) for p16, p32 in zip(g16, g32)}


def hp_states_linked(optimizer) -> bool | None:
    """Whether a ZeRO-1/2 or bf16 wrapper has linked each parameter to its optimizer-state fragment (0.19:
    ``_hp_optimizer_states_linked``, set once by ``_lazy_init_hp_params_optimizer_state`` after the first step);
    None for optimizers without that lazy link."""
    return getattr(optimizer, "_hp_optimizer_states_linked", None)


def unlink_hp_optimizer_states(optimizer) -> None:
    """Mark the fragments unlinked, so the wrapper links them again after its next step (0.19: resets
    ``_hp_optimizer_states_linked``). Used after a step whose update was skipped: the link made then points at
    a still-empty optimizer state."""
    optimizer._hp_optimizer_states_linked = False


def relink_hp_optimizer_states(optimizer) -> None:
    """Link every parameter to its optimizer-state fragment again, now. 0.19's ZeRO-1/2 link right after the first
    optimizer step of the *first* parameter group, before the other groups have state, so the fragments of the
    others stay empty (no ``exp_avg``) until this. No-op for optimizers without the lazy link."""
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def full_optimizer_state(param: torch.nn.Parameter, key: str) -> torch.Tensor:
    """The full optimizer state ``key`` (e.g. ``exp_avg``) of ``param`` in its full shape. Uses the public
    ``deepspeed.utils.safe_get_full_optimizer_state`` (collective); 0.19 returns ZeRO-3 state flat."""
    from deepspeed.utils import safe_get_full_optimizer_state

    return safe_get_full_optimizer_state(param, key).reshape(full_shape(param))


def set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, key: str) -> None:
    """Set the full optimizer state ``key`` of ``param`` (a tensor of its full shape) through the public
    ``deepspeed.utils.safe_set_full_optimizer_state``; 0.19's ZeRO-3 copy expects the flat form."""
    from deepspeed.utils import safe_set_full_optimizer_state

    safe_set_full_optimizer_state(param, value.flatten() if is_partitioned(param) else value, key)


def load_partitioned_optimizer_state(optimizer, state: dict, world_size: int) -> None:
    """Load one rank's ``optimizer.state_dict()`` into a ZeRO optimizer of the same layout. 0.19's ZeRO
    ``load_state_dict`` takes every rank's saved state (a list) and picks its own by data-parallel rank, so this
    rank's state is given for all of them; the fp32 masters come from that state."""
    optimizer.load_state_dict([state] * world_size, load_optimizer_states=True, load_from_fp32_weights=True)
