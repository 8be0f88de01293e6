"""Where a worker starts from: the committed checkpoint to resume (a restart, ``resume RUN_ID``, or
``checkpoint.resume_from``), checked for its expert layout, and restored into module, data and counters."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pretrain.config import RunConfig
from pretrain.data import TrainBatches
from pretrain.train import checkpoint as ckpt_io
from pretrain.train import dist
from pretrain.train.trainer import TrainerState


def find_resume_point(cfg: RunConfig, run_dir: Path, ctx: dist.DistContext) -> ckpt_io.CommittedCheckpoint | None:
    """The run's latest committed checkpoint, else ``checkpoint.resume_from``; verified (checksums, layout).
    Rank 0 first removes leftovers of interrupted saves."""
    if ctx.is_main:
        ckpt_io.cleanup_staging(run_dir)
    dist.barrier()
    resume = ckpt_io.latest_committed(run_dir)
    if resume is None and cfg.checkpoint.resume_from:
        resume = ckpt_io.resolve(Path(cfg.checkpoint.resume_from))
    if resume is not None:
        ckpt_io.verify_or_point_back(resume)
        check_expert_layout(resume, cfg, ctx.world_size)
    return resume


def checkpoint_architecture(cfg: RunConfig, ckpt: ckpt_io.CommittedCheckpoint) -> RunConfig:
    """``cfg`` with the model and MoE sections of the checkpoint's own config (the architecture it was saved with,
    which growth may have changed since the run started); expert parallelism stays as configured now."""
    import yaml

    from pretrain.config import from_dict, to_dict

    saved = yaml.safe_load((ckpt.path / "config.yaml").read_text()) or {}
    if "model" not in saved:
        return cfg
    merged = to_dict(cfg)
    merged["model"] = saved["model"]
    merged["moe"] = {**saved.get("moe", {}), "ep_size": cfg.moe.ep_size}
    return from_dict(merged)


def check_expert_layout(ckpt: ckpt_io.CommittedCheckpoint, cfg: RunConfig, world_size: int) -> None:
    """Expert-parallel state resumes only into the same layout: DeepSpeed partitions the experts' ZeRO state
    over the expert-data-parallel group, which changes with ``moe.ep_size`` and the worker count."""
    saved_ep = int(ckpt.manifest.get("moe_ep_size", 0))
    saved_world = int(ckpt.manifest.get("world_size", world_size))
    ep = cfg.moe.ep_size if cfg.moe.enabled else 0
    if max(saved_ep, ep) <= 1:
        return  # dense or ep_size 1: experts are ordinary data-parallel weights, any worker count works
    if saved_ep != ep or saved_world != world_size:
        raise ckpt_io.CheckpointError(
            f"{ckpt.path}: saved with moe.ep_size={saved_ep} on {saved_world} workers; resuming expert-parallel "
            f"state needs the same layout (got moe.ep_size={ep} on {world_size} workers). Resume with "
            f"moe.ep_size={saved_ep} cluster.num_workers={saved_world}")


def engine_state_dir(ckpt: ckpt_io.CommittedCheckpoint, run_dir: Path, ctx: dist.DistContext) -> tuple[Path, bool]:
    """(directory to load the engine state from, whether it is DeepSpeed's universal form). The checkpoint's own
    DeepSpeed directory when its worker count matches; otherwise its universal form (ZeRO state re-sharded for
    the new worker count), converted once by rank 0 and cached in the run directory."""
    saved_world = int(ckpt.manifest.get("world_size", ctx.world_size))
    if saved_world == ctx.world_size:
        return ckpt.path / ckpt_io.DS_DIR, False
    error, path = None, None
    if ctx.is_main:
        print(f"[train] elastic resume: {saved_world} -> {ctx.world_size} workers, converting the ZeRO "
              f"state to a DeepSpeed universal checkpoint", flush=True)
        try:
            path = ckpt_io.universal_checkpoint(ckpt, run_dir)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{ckpt.path}: cannot re-shard from {saved_world} to {ctx.world_size} workers ({e})"
    error, path = dist.broadcast_object((error, path))
    if error:
        raise ckpt_io.CheckpointError(error)
    return path, True


def restore(module, batches: TrainBatches, ckpt: ckpt_io.CommittedCheckpoint, source: tuple[Path, bool],
            ctx: dist.DistContext) -> TrainerState:
    """Engine state (from ``source``, see :func:`engine_state_dir`), data position, RNG and counters."""
    module.load(*source)
    data_state, rng = ckpt_io.load_rank_state(ckpt.path, ctx.rank)
    batches.load_state_dict(data_state)  # the union of all ranks' streams: any worker count works
    if rng is not None and not source[1]:
        torch.set_rng_state(rng["torch"])
    raw = json.loads((ckpt.path / "trainer_state.json").read_text())
    if "sequences" not in raw:  # written before stability control: no rollback ever moved the data
        raw["sequences"] = int(ckpt.manifest.get("data_position", {}).get("global_sequences", 0))
    return TrainerState.from_dict(raw)
