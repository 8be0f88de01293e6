"""The rules of a model-parallel layout (``cluster.sequence_parallel`` N, ``cluster.tensor_parallel`` M), checked at
config load with the worker count, each refused in one line naming what to set.

Ranks are laid out as ``rank = (d * N + s) * M + t`` (data-parallel index ``d``, sequence-parallel index ``s``,
tensor-parallel index ``t``): tensor-parallel groups are consecutive ranks, as DeepSpeed's AutoTP mesh makes them, and
the ``N * M`` ranks of one data-parallel index train on the same sequences (see ``pretrain/train/model_parallel.py``).
"""

from __future__ import annotations

from typing import Any

from pretrain.config.errors import ConfigError


def check_model_parallel(cfg: Any, world_size: int) -> int:
    """The data-parallel degree of ``cfg`` (a ``RunConfig``; this module sits below ``tree.py``) on ``world_size``
    workers; raises :class:`ConfigError` for a layout that
    cannot work (divisibility) or a pairing this system does not train (MoE or ZeRO-3 with AutoTP, compiled
    blocks)."""
    c, m = cfg.cluster, cfg.model
    n, t = c.sequence_parallel, c.tensor_parallel
    if n == 1 and t == 1:
        return world_size
    mp = n * t
    if world_size % mp:
        raise ConfigError(
            f"cluster.num_workers: {world_size} workers do not divide into groups of sequence_parallel x "
            f"tensor_parallel = {n} x {t}; use a multiple of {mp}"
        )
    heads, kv = m.num_heads, m.num_kv_heads or m.num_heads
    if heads % mp or kv % mp:
        key = "sequence_parallel" if t == 1 else "tensor_parallel" if n == 1 else "sequence_parallel x tensor_parallel"
        raise ConfigError(
            f"cluster.{key}: {mp} must divide model.num_heads ({heads}) and the key-value heads ({kv}, "
            f"model.num_kv_heads); each worker attends over whole heads"
        )
    if n > 1 and m.max_seq_len % n:
        raise ConfigError(
            f"cluster.sequence_parallel: {n} must divide model.max_seq_len ({m.max_seq_len}); each worker holds "
            f"an equal slice of every sequence"
        )
    if t > 1:
        if m.ffn_width() % t:
            raise ConfigError(
                f"cluster.tensor_parallel: {t} must divide the FFN size ({m.ffn_width()}, model.ffn_size)"
            )
        if cfg.zero.stage == 3:
            raise ConfigError(
                "cluster.tensor_parallel: not with zero.stage 3 (the checkpoint gathers AutoTP shards from ZeRO "
                "stages 0-2); use zero.stage 1 or 2"
            )
    if cfg.moe.enabled and t > 1:
        raise ConfigError(
            f"cluster.tensor_parallel: not with MoE (moe.num_experts {cfg.moe.num_experts}): AutoTP does not split "
            f"our experts; use expert parallelism (moe.ep_size), with sequence parallelism if sequences are long"
        )
    if cfg.train.compile == "yes":
        raise ConfigError(
            "train.compile: yes is not supported with cluster.sequence_parallel/tensor_parallel > 1 (their "
            "collectives run between compiled regions); use train.compile=no"
        )
    return world_size // mp
