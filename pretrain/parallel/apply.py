"""The one entry point from training into the parallel layout: what ``build_module`` and the engine call, in order.
Each parallelism is applied by its own module; a new one adds its step here (see "Adding a parallelism" in
docs/architecture.md).

1. :func:`parallelize` on the seeded single-device model: expert parallelism (keep this rank's experts, DeepSpeed
   MoE layers), then sequence parallelism (Ulysses attention; collective: creates the groups).
2. :func:`deepspeed_sections`: the parallelisms' parts of the DeepSpeed config (AutoTP's ``tensor_parallel``).
3. :func:`before_engine` / :func:`after_engine` around ``deepspeed.initialize`` (DeepSpeed splits the AutoTP layers
   and creates the tensor- and expert-parallel groups there).
4. :func:`full_state` / :func:`local_state`: a state dict gathered whole from every parallelism's shards, and split
   back into this rank's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from pretrain import ds_adapter
from pretrain.model import Transformer
from pretrain.parallel import expert, sequence, tensor
from pretrain.parallel.dims import ParallelDims

StateDict = dict[str, torch.Tensor]


def parallelize(model: Transformer, dims: ParallelDims, rank: int) -> None:
    """Apply every parallelism of ``dims`` to ``model`` (global ``rank``) that is applied before the engine is built
    (collective under sequence parallelism)."""
    expert.apply_expert_parallel(model, dims, rank)
    sequence.apply_sequence_parallel(model, dims)


def deepspeed_sections(dims: ParallelDims) -> dict[str, Any]:
    """The DeepSpeed config sections of the parallelisms of ``dims`` (none without model parallelism)."""
    return tensor.deepspeed_section(dims)


def before_engine(dims: ParallelDims) -> None:
    """Right before ``deepspeed.initialize`` (DeepSpeed's groups of another layout dropped)."""
    tensor.prepare_tensor_parallel(dims)


def after_engine(engine: Any) -> None:
    """Right after ``deepspeed.initialize``: the AutoTP input check dropped, its split parameters marked."""
    ds_adapter.drop_tensor_parallel_input_check(engine)
    tensor.mark_shards(engine.module)


def full_state(model: nn.Module, state: StateDict) -> StateDict:
    """``state`` (this rank's, by parameter name) with every shard gathered whole: AutoTP splits, then experts under
    their global ids (collective)."""
    return expert.gather_experts(model, tensor.gather_shards(model, state))


def local_state(model: nn.Module, state: StateDict) -> StateDict:
    """Whole tensors by parameter name -> this rank's shards of the tensor-parallel ones (the experts of a full state
    dict are kept by :func:`parallelize` when the model is built with it)."""
    return tensor.local_shards(model, state)
