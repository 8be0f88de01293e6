"""DeepSpeed's model-parallel machinery: expert-parallel groups and MoE tags, AutoTP's tensor-parallel group and
splits, Ulysses' distributed attention (through :mod:`pretrain.ds_adapter`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# -- Mixture of Experts (expert parallelism) ----------------------------------------------------------------------


def expert_group_name(ep_size: int) -> str:
    """0.19's key of the expert-parallel process groups of one size (``deepspeed.utils.groups``)."""
    return f"ep_size_{ep_size}"


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is tagged as an expert-parallel parameter (``allreduce = False``: 0.19's
    ``deepspeed.moe.utils.is_moe_param``; its gradient is reduced over the expert-data-parallel group only)."""
    return hasattr(param, "allreduce") and not param.allreduce


def tag_expert_layer(layer: torch.nn.Module, experts: torch.nn.Module, ep_size: int) -> None:
    """Tag ``layer`` (a :func:`deepspeed_moe_subclass` instance) and its ``experts``' parameters as 0.19's MoE layer
    does: ``layer.expert_group_name`` (read by the engine's checkpoint code to name the per-expert files) and,
    per parameter, ``allreduce = False`` and ``group_name`` (the engine's gradient reduction and the optimizer
    groups of ``split_params_into_different_moe_groups_for_optimizer`` key on them)."""
    # Attributes DeepSpeed reads, set on torch objects whose types do not declare them.
    layer.expert_group_name = expert_group_name(ep_size)  # type: ignore[assignment]
    for p in experts.parameters():
        p.allreduce = False  # type: ignore[attr-defined]
        p.group_name = layer.expert_group_name  # type: ignore[attr-defined]


def expert_data_parallel_rank(param: torch.Tensor) -> int:
    """This rank's index in the expert-data-parallel group of expert parameter ``param`` (0.19:
    ``groups._get_expert_data_parallel_rank`` by the parameter's ``group_name``)."""
    from deepspeed.utils import groups

    return groups._get_expert_data_parallel_rank(param.group_name)  # type: ignore[attr-defined]  # a DeepSpeed tag


def expert_parallel_group(ep_size: int):
    """The expert-parallel process group of this rank for ``ep_size`` (0.19: ``groups._get_expert_parallel_group``);
    the groups exist once the engine has called the layers' ``set_deepspeed_parallelism``."""
    from deepspeed.utils import groups

    return groups._get_expert_parallel_group(expert_group_name(ep_size))


def _set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
    """0.19's engine calls this on every module that has it during ``initialize``: create (once) the expert-parallel
    and expert-data-parallel groups of ``self.ep_size`` (consecutive ranks form an EP group), check this layer's
    ``ep_rank`` against DeepSpeed's and hand the EP group to the class's ``adopt_group``."""
    from deepspeed.utils import groups

    name = expert_group_name(self.ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(
            self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_
        )
    rank = groups._get_expert_parallel_rank(name)
    if rank != self.ep_rank:
        raise RuntimeError(f"expert layout mismatch: layer built for EP rank {self.ep_rank}, DeepSpeed says {rank}")
    self.adopt_group(groups._get_expert_parallel_group(name))


@functools.cache
def deepspeed_moe_subclass(base: type, adopt_group: Callable[[Any, Any], None], name: str, module: str) -> type:
    """A subclass of ``base`` (with attributes ``ep_size``, ``ep_rank``) that is also ``deepspeed.moe.layer.MoE``
    (public class; what 0.19's engine keys its MoE handling on: expert checkpoint files, ``has_moe_layers``), with
    the engine's parallelism hook: ``adopt_group(layer, expert_parallel_group)`` runs once the groups exist. An
    instance's ``__class__`` is swapped to it (``base.__init__`` must not call ``MoE.__init__``)."""
    from deepspeed.moe.layer import MoE

    return type(
        name,
        (base, MoE),
        {"__module__": module, "set_deepspeed_parallelism": _set_deepspeed_parallelism, "adopt_group": adopt_group},
    )


def tensor_parallel_group():
    """DeepSpeed's tensor-parallel (AutoTP) group of this process, None without one (0.19: groups' global)."""
    from deepspeed.utils import groups

    return groups._TENSOR_MODEL_PARALLEL_GROUP


def tensor_parallel_size() -> int:
    """The size of :func:`tensor_parallel_group`, 1 without one."""
    group = tensor_parallel_group()
    return 1 if group is None else torch.distributed.get_world_size(group)


def distributed_attention(core: Callable, group) -> torch.nn.Module:
    """DeepSpeed Ulysses' ``DistributedAttention`` around ``core(q, k, v)`` for batch-first (B, t, heads, hd) tensors
    (``scatter_idx`` 2 = heads, ``gather_idx`` 1 = sequence; ``batch_dim_idx`` 0 is passed at each call)."""
    from deepspeed.sequence.layer import DistributedAttention

    return DistributedAttention(core, group, scatter_idx=2, gather_idx=1)


def time_model_parallel_collectives(wrap: Callable[[Callable, Callable[..., bool]], Callable]) -> None:
    """For a benchmark: replace Ulysses' all-to-all (0.19: ``deepspeed.sequence.layer.single_all_to_all``) and the
    all-reduce AutoTP's layers call (``deepspeed.comm.all_reduce``) by ``wrap(fn, keep)``, where ``keep(*args,
    **kwargs)`` says whether a call is model-parallel communication (an all-reduce within the tensor-parallel group)."""
    import deepspeed.comm as ds_comm
    import deepspeed.sequence.layer as ulysses

    ulysses.single_all_to_all = wrap(ulysses.single_all_to_all, lambda *a, **k: True)
    group = tensor_parallel_group()
    if group is not None:
        ds_comm.all_reduce = wrap(ds_comm.all_reduce, lambda *a, **k: k.get("group") is group)


def reset_parallel_groups() -> None:
    """Forget DeepSpeed's process-wide parallel groups (tensor/data/expert parallel, its device mesh and ``mpu``)
    so that the next engine creates those of its own layout: an engine of another tensor-parallel size in the same
    processes (0.19: ``groups._release_process_group_references(None)`` drops the references, destroys nothing)."""
    from deepspeed.utils import groups

    groups._release_process_group_references(None)


def tensor_parallel_split(module: torch.nn.Module) -> tuple[int, int | None, list[int], int] | None:
    """How AutoTP split a replaced layer: (weight dim, bias dim or None when the bias is whole, split sizes, this
    rank's index); None for a layer AutoTP left whole. Column-parallel layers split the output dim of weight and
    bias, row-parallel ones (``LinearAllreduce``) the weight's input dim (0.19: ``_partition_sizes``, ``tp_index``)."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    if isinstance(module, LinearAllreduce):
        return 1, None, list(module._partition_sizes), module.tp_index
    if isinstance(module, LinearLayer):
        return 0, 0, list(module._partition_sizes), module.tp_index
    return None


def drop_tensor_parallel_input_check(engine) -> None:
    """Remove the hook AutoTP puts before the first forward, which broadcasts its arguments within the tensor-parallel
    group and compares them (0.19: ``first_dataloader_check``): its comparison fails on tensors inside lists (the
    per-sample layer-dropout gates), and the plan gives the ranks of a group the same sequences by construction."""
    hook = getattr(engine, "first_dataloader_check", None)
    if hook is not None:
        hook.remove()
        engine.first_dataloader_check = None
