"""The rules of a parallel layout (``parallel.sequence`` N, ``parallel.tensor`` M, ``parallel.expert`` E): what
composes with what, checked at config load (``RunConfig.validate`` and ``make_plan``) with the worker count, each
refused in one line naming what to set. The rank layout is in ``dims.py``.

Pure: no torch, and ``ConfigError`` is the only name it takes from the config package (it sits beside it, below
the model; the config tree imports it as a module, ``from pretrain.parallel import rules``).
"""

from __future__ import annotations

from typing import Any

from pretrain.config.errors import ConfigError


def check_degrees(parallel: Any) -> None:
    """Every degree of ``parallel`` (the ``parallel`` section) is >= 1."""
    for name in ("sequence", "tensor", "expert"):
        if getattr(parallel, name) < 1:
            raise ConfigError(f"parallel.{name}: must be >= 1, got {getattr(parallel, name)}")


def check_expert(cfg: Any) -> None:
    """Expert parallelism against the MoE section and the ZeRO stage (an MoE model only; the worker count is
    :func:`check_expert_world`)."""
    ep, moe, stage = cfg.parallel.expert, cfg.moe, cfg.zero.stage
    if not moe.enabled:
        return
    if moe.num_experts % ep:
        raise ConfigError(f"parallel.expert: {ep} must divide moe.num_experts {moe.num_experts}")
    if ep > 1 and stage == 0:
        raise ConfigError(
            "zero.stage: expert parallelism (parallel.expert > 1) needs ZeRO-1 or 2 (DeepSpeed's stage-0 gradient "
            "norm mis-weights expert-parallel gradients); use zero.stage 1 or 2, or parallel.expert 1"
        )
    if ep > 1 and stage == 3:
        raise ConfigError(
            "zero.stage: ZeRO-3 cannot partition expert-parallel weights (parallel.expert > 1); use zero.stage 1 "
            "or 2, or parallel.expert 1 (experts are then sharded by ZeRO-3 like dense weights)"
        )


def check_compile(cfg: Any) -> None:
    """Compiled blocks (``train.compile``) against ZeRO-3: DeepSpeed gathers and releases each layer's partitioned
    weights in hooks on every module inside a block, which a compiled block would break its graph at (and, as the
    partitions change shape, guard on); ``auto`` leaves ZeRO-3 runs eager, ``yes`` is refused."""
    if cfg.train.compile == "yes" and cfg.zero.stage == 3:
        raise ConfigError(
            "train.compile: yes is not supported with zero.stage 3 (DeepSpeed gathers each layer's weights in module "
            "hooks inside the compiled blocks); use train.compile=auto or no, or zero.stage 1 or 2"
        )


def check_expert_world(cfg: Any, world_size: int) -> None:
    """The expert-parallel degree divides the worker count (an MoE model only)."""
    ep = cfg.parallel.expert
    if cfg.moe.enabled and world_size % ep:
        raise ConfigError(f"parallel.expert: {ep} must divide the worker count {world_size} (cluster.num_workers)")


def check_growth(cfg: Any) -> None:
    """Growth's optimizer-moment growth gathers full moments: not with expert parallelism."""
    if cfg.growth.optimizer == "grow" and cfg.parallel.expert > 1:
        raise ConfigError(
            "growth.optimizer: grow gathers full optimizer moments, not with parallel.expert > 1; "
            "use growth.optimizer reset"
        )


def check_model_parallel(cfg: Any, world_size: int) -> int:
    """The data-parallel degree of ``cfg`` (a ``RunConfig``) on ``world_size`` workers under sequence and tensor
    parallelism; raises :class:`ConfigError` for a layout that cannot work (divisibility) or a pairing this system
    does not train (MoE or ZeRO-3 with AutoTP, compiled blocks)."""
    m = cfg.model
    n, t = cfg.parallel.sequence, cfg.parallel.tensor
    if n == 1 and t == 1:
        return world_size
    mp = n * t
    if world_size % mp:
        raise ConfigError(
            f"cluster.num_workers: {world_size} workers do not divide into groups of parallel.sequence x "
            f"parallel.tensor = {n} x {t}; use a multiple of {mp}"
        )
    heads, kv = m.num_heads, m.num_kv_heads or m.num_heads
    if heads % mp or kv % mp:
        key = "sequence" if t == 1 else "tensor" if n == 1 else "sequence x parallel.tensor"
        raise ConfigError(
            f"parallel.{key}: {mp} must divide model.num_heads ({heads}) and the key-value heads ({kv}, "
            f"model.num_kv_heads); each worker attends over whole heads"
        )
    if n > 1 and m.max_seq_len % n:
        raise ConfigError(
            f"parallel.sequence: {n} must divide model.max_seq_len ({m.max_seq_len}); each worker holds "
            f"an equal slice of every sequence"
        )
    if t > 1:
        if m.ffn_width() % t:
            raise ConfigError(f"parallel.tensor: {t} must divide the FFN size ({m.ffn_width()}, model.ffn_size)")
        if cfg.zero.stage == 3:
            raise ConfigError(
                "parallel.tensor: not with zero.stage 3 (the checkpoint gathers AutoTP shards from ZeRO "
                "stages 0-2); use zero.stage 1 or 2"
            )
        if m.attention_dropout > 0:
            raise ConfigError(
                f"parallel.tensor: not with model.attention_dropout {m.attention_dropout:g} (the workers of a "
                f"tensor-parallel group share a dropout seed, which their replicated activations need, so each "
                f"would drop the same attention weights in its own heads); use model.attention_dropout=0"
            )
    if cfg.moe.enabled and t > 1:
        raise ConfigError(
            f"parallel.tensor: not with MoE (moe.num_experts {cfg.moe.num_experts}): AutoTP does not split "
            f"our experts; use expert parallelism (parallel.expert), with sequence parallelism if sequences are long"
        )
    if cfg.train.compile == "yes":
        raise ConfigError(
            "train.compile: yes is not supported with parallel.sequence/tensor > 1 (their "
            "collectives run between compiled regions); use train.compile=no"
        )
    return world_size // mp
