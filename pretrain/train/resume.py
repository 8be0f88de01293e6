"""Where a worker starts from: the committed checkpoint to resume (a restart, ``resume RUN_ID``, or
``checkpoint.resume_from``), checked for its expert layout, and restored into module, data and counters.
A checkpoint holds either DeepSpeed engine state (loaded into the engine, re-sharded for another worker count) or
full weights and optimizer moments (derived runs: the module is built from them, on any layout)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.checkpoint import reader, store, weights
from pretrain.checkpoint.store import CheckpointError, CommittedCheckpoint
from pretrain.config import RunConfig
from pretrain.data import TrainBatches
from pretrain.train import dist
from pretrain.train.trainer import TrainerState


def find_resume_point(cfg: RunConfig, run_dir: Path, ctx: dist.DistContext) -> CommittedCheckpoint | None:
    """The run's latest committed checkpoint, else ``checkpoint.resume_from``; verified (layout; file presence and
    sizes; checksums with every rank hashing its share of the files in parallel, see :func:`verify_in_parallel`).
    Rank 0 first removes leftovers of interrupted saves."""
    if ctx.is_main:
        store.cleanup_staging(run_dir)
    dist.barrier()
    resume = store.latest_committed(run_dir)
    if resume is None and cfg.checkpoint.resume_from:
        resume = store.resolve(Path(cfg.checkpoint.resume_from), full=False)
    if resume is not None:
        store.verify_or_point_back(resume, full=False)
        check_expert_layout(resume, cfg, ctx.world_size)
        verify_in_parallel(resume, ctx)
    return resume


def verify_in_parallel(ckpt: CommittedCheckpoint, ctx: dist.DistContext) -> None:
    """Every rank hashes its share of the checkpoint's files (:func:`store.verifying_rank`: its own per-rank files,
    rank 0 the shared ones), in parallel; all ranks then raise the same one-line error naming the first bad file,
    or none, before anything is loaded (a rank may load a file another rank verified)."""
    try:
        store.verify_share(ckpt.path, ckpt.manifest, ctx.rank, ctx.world_size)
        error = None
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in dist.gather_object(error) if e]
    # Rank 0 names the newest older checkpoint that verifies in full, as the driver's early check does for a
    # missing or truncated file (a same-size corruption only shows here).
    error = dist.broadcast_object(store.point_back(ckpt, errors[0]) if errors else None)
    if error:
        raise CheckpointError(error)


def checkpoint_architecture(cfg: RunConfig, ckpt: CommittedCheckpoint) -> RunConfig:
    """``cfg`` with the model and MoE sections of the checkpoint's own config (the architecture it was saved with,
    which growth may have changed since the run started); expert parallelism stays as configured now."""
    from pretrain.config import from_dict, to_dict

    saved = reader.config_dict(ckpt)
    if "model" not in saved:
        return cfg
    merged = to_dict(cfg)
    merged["model"] = saved["model"]
    merged["moe"] = {**saved.get("moe", {}), "ep_size": cfg.moe.ep_size}
    return from_dict(merged)


def check_expert_layout(ckpt: CommittedCheckpoint, cfg: RunConfig, world_size: int) -> None:
    """Expert-parallel engine state resumes only into the same layout: DeepSpeed partitions the experts' ZeRO state
    over the expert-data-parallel group, which changes with ``moe.ep_size`` and the worker count. Full weights
    (every expert under its global id) resume on any layout."""
    if reader.is_full_weights(ckpt):
        return
    saved_ep = ckpt.manifest.moe_ep_size
    saved_world = ckpt.manifest.world_size
    ep = cfg.moe.ep_size if cfg.moe.enabled else 0
    if max(saved_ep, ep) <= 1:
        return  # dense or ep_size 1: experts are ordinary data-parallel weights, any worker count works
    if saved_ep != ep or saved_world != world_size:
        raise CheckpointError(
            f"{ckpt.path}: saved with moe.ep_size={saved_ep} on {saved_world} workers; resuming expert-parallel "
            f"state needs the same layout (got moe.ep_size={ep} on {world_size} workers). Resume with "
            f"moe.ep_size={saved_ep} cluster.num_workers={saved_world}")


def engine_state_dir(ckpt: CommittedCheckpoint, run_dir: Path, ctx: dist.DistContext) -> tuple[Path, bool]:
    """(directory to load the engine state from, whether it is DeepSpeed's universal form). The checkpoint's own
    DeepSpeed directory when its worker count matches; otherwise its universal form (ZeRO state re-sharded for
    the new worker count), converted once by rank 0 and cached in the run directory."""
    saved_world = ckpt.manifest.world_size
    if saved_world == ctx.world_size:
        return weights.ds_engine_dir(ckpt.path), False
    error, path = None, None
    if ctx.is_main:
        print(f"[train] elastic resume: {saved_world} -> {ctx.world_size} workers, converting the ZeRO "
              f"state to a DeepSpeed universal checkpoint", flush=True)
        try:
            path = weights.universal_checkpoint(ckpt, run_dir)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{ckpt.path}: cannot re-shard from {saved_world} to {ctx.world_size} workers ({e})"
    error, path = dist.broadcast_object((error, path))
    if error:
        raise CheckpointError(error)
    return path, True


@dataclass
class ResumeSource:
    """How to put a checkpoint's model state in place: engine state to load (``engine_dir``, ``universal``), or
    full weights to build the module from (``weights``, with ``moments`` to load after)."""

    ckpt: CommittedCheckpoint
    engine_dir: Path | None = None
    universal: bool = False
    weights: dict[str, torch.Tensor] | None = None
    moments: dict | None = None


def resume_source(ckpt: CommittedCheckpoint, run_dir: Path, ctx: dist.DistContext) -> ResumeSource:
    """What ``ckpt`` holds, ready to restore: its full weights and moments, or where its engine state is (for
    another worker count: the universal form, see :func:`engine_state_dir`)."""
    if reader.is_full_weights(ckpt):
        return ResumeSource(ckpt, weights=weights.load_full_weights(ckpt.path),
                            moments=weights.load_optimizer_moments(ckpt.path))
    return ResumeSource(ckpt, *engine_state_dir(ckpt, run_dir, ctx))


def load_model_state(module, source: ResumeSource, built: bool = False) -> None:
    """Put ``source``'s model (and optimizer) state into ``module``: the engine loads its state; full weights
    rebuild the module (unless it was ``built`` from them, as a resume does) and its optimizer takes the moments."""
    if source.engine_dir is not None:
        module.load(source.engine_dir, source.universal)
        return
    if not built:
        module.rebuild(module.cfg, source.weights)
    if source.moments is not None:
        from pretrain.train.optimizer_state import load_moments

        load_moments(module, source.moments)


def rollback_loader(module, run_dir: Path, ctx: dist.DistContext):
    """``load(ckpt)`` for a stability rollback: the checkpoint's model state into ``module``, either format."""
    return lambda ckpt: load_model_state(module, resume_source(ckpt, run_dir, ctx))


def restore(module, batches: TrainBatches, source: ResumeSource, ctx: dist.DistContext) -> TrainerState:
    """Model state (see :func:`load_model_state`; full weights: ``module`` was built from them), data position,
    RNG and counters."""
    ckpt = source.ckpt
    load_model_state(module, source, built=True)
    data_state, rng = reader.load_rank_state(ckpt.path, ctx.rank)
    batches.load_state_dict(data_state)  # the union of all ranks' streams: any worker count works
    if rng is not None and not source.universal:
        torch.set_rng_state(rng["torch"])
    return TrainerState.from_dict(reader.read_trainer_state(ckpt))
