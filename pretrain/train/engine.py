"""DeepSpeed engine from the typed config. The DeepSpeed JSON is a pure function of the config."""

from __future__ import annotations

import os
from typing import Any

import torch

from pretrain import ds_adapter
from pretrain.config import ConfigError, RunConfig, RunPlan
from pretrain.parallel.apply import after_engine, before_engine, deepspeed_sections


def resolve_precision(requested: str, device: torch.device) -> str:
    """``auto`` -> bf16 on GPUs that compute in it natively (Ampere and later: not torch's emulation on older ones,
    slower than fp32 there), else fp32. bf16 on CPU is allowed when asked for."""
    if requested != "auto":
        return requested
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16"
    return "fp32"


def deepspeed_config(cfg: RunConfig, plan: RunPlan, precision: str, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg`` under ``plan``. ``load_universal``: the engine will load a
    universal checkpoint (resuming with a different number of workers). DeepSpeed's batch size is the
    nominal micro x accumulation x workers (the plan pads uneven shares to equal passes; DeepSpeed counts every
    worker, also those that share sequences under sequence or tensor parallelism)."""
    t, z = cfg.train, cfg.zero
    zero: dict[str, Any] = {"stage": z.stage}
    if z.stage > 0:
        zero.update(reduce_bucket_size=z.reduce_bucket_size, overlap_comm=z.overlap_comm, contiguous_gradients=True)
    if z.stage >= 2:
        zero["allgather_bucket_size"] = z.reduce_bucket_size
    if z.stage == 3:
        zero.update(
            stage3_gather_16bit_weights_on_model_save=False,
            stage3_param_persistence_threshold=z.param_persistence_threshold,
        )
        if cfg.layer_drop.enabled and cfg.layer_drop.mode == "layer":
            # DeepSpeed prefetches along the module order it recorded at an earlier step, so it would all-gather
            # the parameters of blocks that layer dropout skips this step. No prefetch: only what runs is gathered
            # (costs the gather/compute overlap on GPUs; none on CPU).
            zero["stage3_prefetch_bucket_size"] = 0
    extra: dict[str, Any] = {}
    if precision == "bf16":
        # DeepSpeed's bf16 defaults add each micro-batch's gradients into bf16 and reduce them in bf16 (8 bits of
        # mantissa: the sum of N micro-batches loses about log2(N) of them). Gradients are summed and reduced in
        # fp32, as Megatron-LM does for bf16: ZeRO-1 through DeepSpeed's BF16_Optimizer (fp32 gradients beside the
        # bf16 weights), ZeRO-2/3 into fp32 gradient partitions. ZeRO-0 cannot (0.19 refuses a grad_accum_dtype
        # other than the weights' there): its micro-batches add in bf16, its reduction is fp32.
        extra["communication_data_type"] = "fp32"
        if z.stage > 0:
            extra["data_types"] = {"grad_accum_dtype": "fp32"}
    if offloads_optimizer(cfg):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        # DeepSpeed refuses any client optimizer but its own CPU Adam under offload unless told otherwise; ours
        # is torch's fused AdamW (build_optimizer), a vectorized multi-threaded host kernel that needs no C++ op
        # built at first use.
        extra["zero_force_ds_cpu_optimizer"] = False
    return {
        "train_batch_size": plan.micro_batch * plan.grad_accum * plan.workers,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
        **extra,
        **({"checkpoint": {"load_universal": True}} if load_universal else {}),
        **deepspeed_sections(plan.dims),
    }


def offloads_optimizer(cfg: RunConfig) -> bool:
    """ZeRO keeps the fp32 masters and the AdamW moments in host memory and steps them there
    (``zero.offload_optimizer``, stages 1-3)."""
    return cfg.zero.offload_optimizer and cfg.zero.stage > 0


def build_optimizer(param_groups: list[dict], cfg: RunConfig) -> torch.optim.Optimizer:
    """A torch AdamW (not DeepSpeed's CPU Adam, whose C++ op is JIT-built at first use). Offloaded, DeepSpeed steps
    it on the host's fp32 partitions: there it is the fused implementation (torch's vectorized, multi-threaded CPU
    kernel), not the per-tensor loop torch otherwise picks for host tensors; on the GPU torch's default
    (``foreach``) stands."""
    t = cfg.train
    fused = True if offloads_optimizer(cfg) else None
    return torch.optim.AdamW(param_groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused)


def expert_param_groups(param_groups: list[dict]) -> list[dict]:
    """Split expert-parallel parameters into their own groups (``moe: True``, named by EP group) as DeepSpeed
    requires, so ZeRO reduces and partitions them over the expert-data-parallel group only."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    if not any(ds_adapter.is_expert_param(p) for g in param_groups for p in g["params"]):
        return param_groups
    named = [{**g, "name": g.get("name", f"group{i}")} for i, g in enumerate(param_groups)]
    return [g for g in split_params_into_different_moe_groups_for_optimizer(named) if g["params"]]


def check_tensor_parallel_device(tensor: int, device: torch.device | None) -> None:
    """DeepSpeed's AutoTP (``parallel.tensor`` > 1) selects the GPU numbered ``LOCAL_RANK`` while it partitions the
    model (0.19's ``_apply_autotp_partitioning``), whatever GPU this worker runs on: refused in one line where that is
    another (each worker seeing only its own GPU, as Slurm's ``--gpus-per-task=1`` gives, or Ray's order)."""
    if tensor <= 1 or device is None or device.type != "cuda" or device.index is None:
        return
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.strip().isdigit() and int(local) != device.index:
        raise ConfigError(
            f"parallel.tensor={tensor}: DeepSpeed's tensor parallelism would select GPU {int(local)} (LOCAL_RANK) "
            f"while this worker runs on cuda:{device.index}; let every worker of a node see all its GPUs "
            "(torchrun, or Slurm's --gpus-per-node instead of --gpus-per-task), or parallel.tensor=1"
        )


def initialize(
    model: torch.nn.Module,
    param_groups: list[dict],
    cfg: RunConfig,
    plan: RunPlan,
    precision: str,
    load_universal: bool = False,
    device: torch.device | None = None,
):
    """Wrap ``model`` (already parallelized, on ``device``) in a DeepSpeed engine that stays on ``device``;
    torch.distributed must already be initialized. Use :func:`pretrain.train.module.build_module`, not this,
    directly."""
    import deepspeed  # heavy import, kept local

    check_tensor_parallel_device(cfg.parallel.tensor, device)
    optimizer = build_optimizer(expert_param_groups(param_groups), cfg)
    before_engine(plan.dims)
    ds_adapter.skip_shm_comm_op(torch.distributed.get_world_size())
    engine, _, _, _ = deepspeed.initialize(
        args=ds_adapter.engine_args(device or torch.device("cpu")),
        model=model,
        optimizer=optimizer,
        config=deepspeed_config(cfg, plan, precision, load_universal),
        dist_init_required=False,
    )
    ds_adapter.use_weights_only_loading(engine)  # a checkpoint file cannot run code
    after_engine(engine)
    return engine


def set_lr(engine, lr: float) -> None:
    for group in engine.optimizer.param_groups:
        group["lr"] = lr
