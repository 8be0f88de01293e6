"""The one module that touches DeepSpeed's private attributes and undocumented internals.

Everything else uses DeepSpeed's documented API only (``deepspeed.initialize``, the engine's public methods,
``deepspeed.zero.GatheredParameters``, the ``deepspeed.utils.safe_*`` accessors, ``zero_to_fp32``,
``deepspeed.moe.layer.MoE``); ``tests/unit/house/test_ds_adapter.py`` fails when another module reads a DeepSpeed
internal. A DeepSpeed upgrade is checked here: each function says which behaviour it relies on. Written and tested
against DeepSpeed 0.19.8 (``requirements.lock``); "0.19" below means that version.

It knows nothing of our packages (engines, optimizers and parameters come in as plain objects), so every layer that
holds DeepSpeed objects can use it: it sits in the lowest tier of ``.importlinter`` beside ``pretrain.model`` and
``pretrain.data``, and ``pretrain.model`` may not import it (its DeepSpeed imports are forbidden there).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

Views = list[tuple[torch.nn.Parameter, torch.Tensor]]

# -- communication backend ------------------------------------------------------------------------------------------


SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_op(world_size: int) -> None:
    """A world of one has no peer to reduce with, so DeepSpeed's shared-memory CPU all-reduce op is not built for
    it. 0.19: ``deepspeed.comm.torch.build_shm_op`` builds it (a JIT C++ build on its first use on a machine, tens
    of seconds) when the communication backend starts in ``deepspeed.initialize``, unless
    ``deepspeed.ops.__compatible_ops__`` marks it incompatible; marked so, the backend uses torch.distributed alone.
    Larger worlds keep the op (DeepSpeed's CPU all-reduce)."""
    if world_size == 1:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


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


# -- engine and checkpoints ---------------------------------------------------------------------------------------


def engine_args(device: torch.device) -> Any:
    """The ``args`` of ``deepspeed.initialize`` that keep the engine on ``device`` (None off CUDA). 0.19's engine
    calls ``set_device`` on ``args.device_rank`` when the args have one, else on the ``LOCAL_RANK`` environment
    variable (``_set_distributed_vars``): not this worker's GPU where each worker sees only its own (Slurm's
    ``--gpus-per-task=1``: an invalid ordinal from local rank 1 on), nor where Ray assigned the node's GPUs in
    another order. AutoTP's partitioning still selects ``LOCAL_RANK``'s device (``_apply_autotp_partitioning``)."""
    if device.type != "cuda" or device.index is None:
        return None
    return types.SimpleNamespace(device_rank=device.index)


def loaded_accelerator() -> str | None:
    """The device type of the accelerator DeepSpeed chose (``cuda``, ``cpu``, ...), or None before DeepSpeed is
    imported. 0.19 chooses it once, at import, from ``DS_ACCELERATOR`` or by probing (``get_accelerator``)."""
    if "deepspeed" not in sys.modules:
        return None
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def set_universal_load(engine, universal: bool) -> None:
    """Whether the engine's next ``load_checkpoint`` reads DeepSpeed's universal form (another worker count). 0.19
    reads it from the engine's config at load time (``engine.load_universal_checkpoint()`` returns
    ``engine._config.load_universal_checkpoint``); the config key ``checkpoint.load_universal`` only sets it at
    ``initialize``."""
    engine._config.load_universal_checkpoint = universal


# The only non-tensor globals in 0.19's ZeRO checkpoint files (torch.serialization's
# get_unsafe_globals_in_checkpoint on ZeRO-1/2/3 model and optimizer states).
CHECKPOINT_GLOBALS = (
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
)


def checkpoint_safe_globals() -> list:
    """The classes of :data:`CHECKPOINT_GLOBALS`, for ``torch.serialization.safe_globals`` around a
    ``torch.load(..., weights_only=True)`` of a DeepSpeed checkpoint file."""
    return [getattr(importlib.import_module(mod), name) for mod, name in CHECKPOINT_GLOBALS]


_RANK_STATE_FILE = re.compile(r"(?:^|/)(?:\w*_)?pp_rank_(\d+)_")


def rank_of_state_file(rel: str) -> int | None:
    """The data-parallel rank whose partition a DeepSpeed checkpoint file holds (0.19 names them
    ``[bf16_]zero_pp_rank_R_mp_rank_00_{optim,model}_states.pt``), or None for a shared file."""
    m = _RANK_STATE_FILE.search(rel)
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def without_zip_crc():
    """``torch.save`` without the zip format's CRC-32 of every record (``torch.utils.serialization.config``,
    torch >= 2.6): our checkpoint files carry a sha256 each, so the CRC is a second checksum of the same bytes and
    a large share of ``torch.save``'s CPU time. ``torch.load`` reads such files as any other. The setting is the
    calling thread's (torch's config module keeps overrides per thread): enter the block in the thread that
    writes."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6
        config = None
    save = getattr(config, "save", None)
    if save is None or not hasattr(save, "compute_crc32"):
        yield
        return
    before, save.compute_crc32 = save.compute_crc32, False
    try:
        yield
    finally:
        save.compute_crc32 = before


Save = Callable[[Any, Any], None]
"""The checkpoint engine's own save of one file: ``save(state_dict, target)``, ``target`` a path or, when
:func:`saves_into_files`, an open binary file."""


def saves_into_files(engine) -> bool:
    """The engine's checkpoint engine saves with DeepSpeed's ``TorchCheckpointEngine.save``, which hands its target
    to ``torch.save`` as is, so it can write into an open file (e.g. one that hashes what it is given). Ours is
    a subclass that changes loading only (:func:`use_weights_only_loading`)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type(engine.checkpoint_engine).save is TorchCheckpointEngine.save


def checkpoint_state_stays_live(engine) -> bool:
    """The state dicts ``save_checkpoint`` hands to its checkpoint engine stay valid until the next step: no
    checkpoint epilogue swaps the optimizer state out again (ZeRO-3 with NVMe offload has one). Only then may a
    synchronous save write them after ``save_checkpoint`` returns (:func:`routing_checkpoint_files`)."""
    return not engine._optimizer_has_ckpt_event_epilogue()


@contextlib.contextmanager
def routing_checkpoint_files(engine, route: Callable[[Any, Path, Save], None]):
    """Within the block, every file the engine's checkpoint engine would save is handed to ``route(state_dict,
    path, save)`` instead, ``save`` being the engine's own (``torch.save`` with its serialization setting) for the
    route to call now, later or elsewhere (e.g. after copying the state to host memory for a background write).
    Wraps ``engine.checkpoint_engine.save`` (0.19: every model, optimizer and expert file of ``save_checkpoint``
    goes through it; its collectives and directory creation still run; only rank 0's recovery scripts are
    copied directly, at once) on the instance, restored afterwards. ZeRO's ``optimizer.state_dict()`` holds the
    live tensors."""
    ckpt_engine = engine.checkpoint_engine
    ds_save = ckpt_engine.save

    def routed(state_dict, path, *args, **kwargs):
        route(state_dict, Path(path), ds_save)

    ckpt_engine.save = routed
    try:
        yield
    finally:
        del ckpt_engine.save  # the class's method again


def use_weights_only_loading(engine) -> None:
    """Make the engine unpickle its checkpoint files with ``weights_only=True`` and the allowlist of
    :func:`checkpoint_safe_globals` (0.19's ``TorchCheckpointEngine.load`` uses ``weights_only=False``), so a
    checkpoint cannot run code. Replaces ``engine.checkpoint_engine`` (built from ``engine._config``) by a
    subclass; another configured engine (async, Nebula) is left alone."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        return
    allowed = checkpoint_safe_globals()

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)


def module_state_files(tag_dir: Path) -> list[Path]:
    """The per-rank module state files of one checkpoint tag directory, rank 0 first. 0.19's layout:
    ``mp_rank_{mp:02d}_model_states.pt`` (ZeRO-3: ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt``),
    each a dict whose ``module`` entry is the module state dict (ZeRO-3: placeholders)."""
    return sorted(tag_dir.glob("mp_rank_*_model_states.pt"))


def expert_state_files(tag_dir: Path) -> list[Path]:
    """0.19's one file per expert of an expert-parallel checkpoint,
    ``layer_{l}_expert_{e}_mp_rank_{mp:02d}_model_states.pt``: a plain state dict whose keys carry the global
    expert id."""
    return sorted(tag_dir.glob("layer_*_expert_*_mp_rank_*_model_states.pt"))


def load_module_state(path: Path, weights_only: bool = True) -> dict:
    """The module state dict in one of :func:`module_state_files` (its ``module`` entry), on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=weights_only)["module"]


def zero_optimizer_files(tag_dir: Path) -> list[Path]:
    """The ZeRO-1/2 optimizer files of one checkpoint tag directory, one per data-parallel rank in rank order (0.19:
    ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``, R the rank in the dense data-parallel group)."""
    files = [f for f in tag_dir.glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt")]
    return sorted(files, key=lambda f: cast(int, rank_of_state_file(f.name)))  # the glob matches rank files only


def zero_partitions(path: Path) -> list[dict[str, Any]]:
    """The partitions one rank's ZeRO-1/2 optimizer file holds, one per optimizer parameter group:
    ``{"partitions": n, "moe": bool, "step": int, "fp32" | "exp_avg" | "exp_avg_sq": flat tensor,
    "slices": {parameter name: (start, numel)}}``. 0.19's ``optimizer_state_dict`` keeps per group the flat fp32
    partition (``single_partition_of_fp32_groups``), the torch optimizer's state of it (``base_optimizer_state``,
    unless ``elastic_checkpoint``), the group's partition count (the size of its data-parallel group: the
    expert-data-parallel group for ``moe`` groups) and ``param_slice_mappings``: each module parameter (its name in
    the engine's module, experts under local ids) with a fragment in this partition -> ``fragment_address``."""
    with torch.serialization.safe_globals(checkpoint_safe_globals()):
        sd = torch.load(path, map_location="cpu", weights_only=True)["optimizer_state_dict"]
    base = sd["base_optimizer_state"]
    if not isinstance(base, dict):
        raise ValueError(f"{path.name}: elastic ZeRO optimizer state is not supported")
    groups = []
    for i, fp32 in enumerate(sd["single_partition_of_fp32_groups"]):
        state = base["state"][base["param_groups"][i]["params"][0]]
        groups.append(
            {
                "partitions": int(sd["partition_count"][i]),
                "moe": bool(base["param_groups"][i].get("moe")),
                "step": int(state["step"]),
                "fp32": fp32,
                "exp_avg": state["exp_avg"],
                "exp_avg_sq": state["exp_avg_sq"],
                "slices": {name: (a.start, a.numel) for name, a in sd["param_slice_mappings"][i].items()},
            }
        )
    return groups


def convert_to_universal(input_folder: Path, output_folder: Path) -> None:
    """Convert one DeepSpeed checkpoint tag directory into the universal form in ``output_folder`` (single process;
    missing optimizer state injected). 0.19 has no function API for it: this runs the ``ds_to_universal`` script's
    ``main`` on its own argument parser."""
    from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

    argv, sys.argv = (
        sys.argv,
        [
            "ds_to_universal",
            "--input_folder",
            str(input_folder),
            "--output_folder",
            str(output_folder),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",
        ],
    )
    try:
        main(parse_arguments())
    finally:
        sys.argv = argv


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
