"""Where a worker starts from: the committed checkpoint to resume (a restart, ``resume RUN_ID``, or
``checkpoint.resume_from``), verified, and restored into module, data and counters.
A checkpoint holds either DeepSpeed engine state (loaded into the engine, re-sharded for another worker count) or
full weights and optimizer moments (derived runs: the module is built from them, on any layout). Expert-parallel
engine state resumed on another expert layout is converted to the full form first, so it too resumes anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.checkpoint import conversions, reader, store, weights
from pretrain.checkpoint.store import BadCheckpoint, CheckpointError, CommittedCheckpoint
from pretrain.config import RunConfig
from pretrain.data import TrainBatches
from pretrain.train import dist
from pretrain.train.trainer import TrainerState


def find_resume_point(cfg: RunConfig, run_dir: Path, ctx: dist.DistContext) -> CommittedCheckpoint | None:
    """The run's latest committed checkpoint, else ``checkpoint.resume_from``; verified (layout; file presence and
    sizes; checksums with every rank hashing its share of the files in parallel, see :func:`verify_in_parallel`).
    Rank 0 first removes leftovers of interrupted saves and the cached conversions of checkpoints that are gone.
    Rank 0's choice is every rank's: a rank whose listing of the run directory differs (a shared filesystem's
    cached listing just after a commit) opens the checkpoint rank 0 chose, never another step."""
    if ctx.is_main:
        store.cleanup_staging(run_dir)
    dist.barrier()
    resume = store.latest_committed(run_dir, full=False)
    if resume is None and cfg.checkpoint.resume_from:
        resume = store.resolve(Path(cfg.checkpoint.resume_from), full=False)
    chosen = dist.broadcast_object(str(resume.path) if resume is not None else None)
    error = None
    if (str(resume.path) if resume is not None else None) != chosen:
        try:
            resume = store.resolve(Path(chosen), full=False) if chosen is not None else None
        except CheckpointError as e:  # said by every rank: the others would wait for this one in a collective
            error = f"rank {ctx.rank}: {e}"
    errors = [e for e in dist.gather_object(error) if e]
    error = dist.broadcast_object(errors[0] if errors else None)
    if error:
        raise CheckpointError(error)
    if ctx.is_main:  # (only rank 0 makes and removes conversions, later in this job)
        conversions.remove_stale(run_dir, keep=resume)
    if resume is not None:
        store.verify_or_point_back(resume, full=False, hash_parsed=False)  # (the next line hashes every byte once)
        verify_in_parallel(resume, ctx)
    return resume


def verify_in_parallel(ckpt: CommittedCheckpoint, ctx: dist.DistContext) -> None:
    """Every rank hashes its share of the checkpoint's files (:func:`store.verifying_rank`: its own per-rank files,
    rank 0 the shared ones), in parallel; all ranks then raise the same one-line error naming the first bad file,
    or none, before anything is loaded (a rank may load a file another rank verified)."""
    try:
        store.verify_share(ckpt.path, ckpt.manifest, ctx.rank, ctx.world_size)
        error = None
    except CheckpointError as e:  # (its message, and whether it is a bad checkpoint or an I/O error)
        error = (str(e), isinstance(e, BadCheckpoint))
    errors = [e for e in dist.gather_object(error) if e]
    # Rank 0 names the newest older checkpoint that verifies in full, as the driver's early check does for a
    # missing or truncated file (a same-size corruption only shows here).
    first = (store.point_back(ckpt, errors[0][0]), errors[0][1]) if errors else None
    error = dist.broadcast_object(first)
    if error:
        raise (BadCheckpoint if error[1] else CheckpointError)(error[0])


def checkpoint_architecture(cfg: RunConfig, ckpt: CommittedCheckpoint) -> RunConfig:
    """``cfg`` with the architecture the checkpoint was saved with, which growth may have changed since the run
    started: the fields growth changes (:data:`pretrain.model.growth.GROWN_FIELDS`) as the checkpoint's own config
    has them, every other field as ``cfg`` sets it (a resume's ``model.dropout=0.1`` applies). Expert parallelism
    stays as configured now, where the saved expert count allows it (else 1, as the growth into those experts set it:
    ``callbacks.growth.grown_config``). The caller plans the run (``make_plan``) from the result."""
    from pretrain.config import from_dict, to_dict
    from pretrain.model.growth import GROWN_FIELDS

    saved = reader.config_dict(ckpt)
    if "model" not in saved:
        return cfg
    merged = to_dict(cfg)
    for section, fields in GROWN_FIELDS.items():
        grown = saved.get(section) or {}
        merged[section] = {**merged[section], **{name: grown[name] for name in fields if name in grown}}
    experts = int(merged["moe"].get("num_experts", 0) or 0)
    if experts > 0 and experts % int(merged["parallel"]["expert"]):
        merged["parallel"] = {**merged["parallel"], "expert": 1}
    return from_dict(merged)


def expert_layout_changed(ckpt: CommittedCheckpoint, ep_size: int, world_size: int) -> bool:
    """Whether ``ckpt`` holds expert-parallel engine state of another layout than ``ep_size`` (0: no MoE) on
    ``world_size`` workers. DeepSpeed partitions the experts' ZeRO state over the expert-data-parallel group, which
    changes with ``parallel.expert`` and the worker count, and loads it (also its universal form) only into the same
    groups: such a checkpoint resumes through its full form (:func:`reader.resharded_full_form`). Full weights, dense
    checkpoints and ``ep_size`` 1 on both sides (experts are then ordinary data-parallel weights, re-sharded for
    another worker count by the universal form) need no conversion."""
    saved_ep, saved_world = ckpt.manifest.moe_ep_size, ckpt.manifest.world_size
    if reader.is_full_weights(ckpt) or saved_ep == 0 or max(saved_ep, ep_size) <= 1:
        return False
    return saved_ep != ep_size or saved_world != world_size


def _converted(ctx: dist.DistContext, convert, what: str) -> Path:
    """``convert()`` run once by rank 0 (a checkpoint conversion cached in the run directory); its path, or the same
    one-line error, on every rank."""
    error, path, bad = None, None, False
    if ctx.is_main:
        try:
            path = convert()
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{what} ({e})" if not isinstance(e, CheckpointError) else str(e)
            bad = isinstance(e, BadCheckpoint)  # (a refusal no retry passes, kept as such on every rank)
    error, path, bad = dist.broadcast_object((error, path, bad))
    if error:
        raise (BadCheckpoint if bad else CheckpointError)(error)
    return path


def engine_state_dir(ckpt: CommittedCheckpoint, run_dir: Path, ctx: dist.DistContext) -> tuple[Path, bool]:
    """(directory to load the engine state from, whether it is DeepSpeed's universal form). The checkpoint's own
    DeepSpeed directory when its worker count matches, or when it is ZeRO-0 (its model and optimizer state are
    whole, in one file every rank loads); otherwise its universal form (ZeRO state re-sharded for the new worker
    count), converted once by rank 0 and cached in the run directory."""
    saved_world = ckpt.manifest.world_size
    if saved_world == ctx.world_size or reader.load(ckpt).config.zero.stage == 0:
        return weights.ds_engine_dir(ckpt.path), False
    if ctx.is_main:
        print(
            f"[train] elastic resume: {saved_world} -> {ctx.world_size} workers, converting the ZeRO "
            f"state to a DeepSpeed universal checkpoint",
            flush=True,
        )
    return _converted(
        ctx,
        lambda: weights.universal_checkpoint(ckpt, run_dir),
        f"{ckpt.path}: cannot re-shard from {saved_world} to {ctx.world_size} workers",
    ), True


@dataclass
class ResumeSource:
    """How to put a checkpoint's model state in place: engine state to load (``engine_dir``, ``universal``), or
    full weights to build the module from (``weights``, with ``moments`` to load after)."""

    ckpt: CommittedCheckpoint
    engine_dir: Path | None = None
    universal: bool = False
    weights: dict[str, torch.Tensor] | None = None
    moments: dict | None = None


def resume_source(
    ckpt: CommittedCheckpoint, run_dir: Path, ctx: dist.DistContext, ep_size: int, tensor_parallel: int = 1
) -> ResumeSource:
    """What ``ckpt`` holds, ready to restore into a module with expert parallelism ``ep_size`` (0: no MoE) and
    ``tensor_parallel`` AutoTP degree: its full weights and moments (for expert-parallel engine state of another
    layout, or engine state resumed with tensor parallelism: its full form, see :func:`expert_layout_changed`), or
    where its engine state is (for another worker count: the universal form, see :func:`engine_state_dir`)."""
    path = ckpt.path
    convert = None  # (what the line says, the error if it fails): engine state to be resumed as full weights
    if tensor_parallel > 1 and not reader.is_full_weights(ckpt):
        convert = (
            f"tensor parallel resume: converting the engine state of {ckpt.path.name} to full weights and "
            f"optimizer moments",
            f"{ckpt.path}: cannot convert to full weights for parallel.tensor={tensor_parallel}",
        )
    elif expert_layout_changed(ckpt, ep_size, ctx.world_size):
        saved = f"parallel.expert={ckpt.manifest.moe_ep_size} on {ckpt.manifest.world_size} workers"
        convert = (
            f"expert re-layout: {saved} -> parallel.expert={ep_size} on {ctx.world_size} workers, converting the "
            f"checkpoint to full weights and optimizer moments",
            f"{ckpt.path}: cannot re-shard the experts saved with {saved}",
        )
    elif not reader.is_full_weights(ckpt):
        return ResumeSource(ckpt, *engine_state_dir(ckpt, run_dir, ctx))
    if convert is not None:
        if ctx.is_main:
            print(f"[train] {convert[0]}", flush=True)
        path = _converted(ctx, lambda: reader.resharded_full_form(ckpt, run_dir), convert[1])
    return ResumeSource(ckpt, weights=weights.load_full_weights(path), moments=weights.load_optimizer_moments(path))


def ep_size_of(cfg: RunConfig) -> int:
    """The expert-parallel degree a module of ``cfg`` has (0: no MoE), what :func:`resume_source` resumes into."""
    return cfg.parallel.expert if cfg.moe.enabled else 0


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
    return lambda ckpt: load_model_state(
        module, resume_source(ckpt, run_dir, ctx, ep_size_of(module.cfg), module.plan.dims.tensor)
    )


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
