"""Derived runs: a new MLflow run (a child of its parent's) whose first committed checkpoint is a transformed copy of
a parent checkpoint — the parent's weights reshaped, its data position and counters carried over — so the new run
evaluates, resumes and exports like any other. This module is what the commands that derive runs share
(:func:`derive_run`, :func:`parent_engine_state`, :func:`parse_options`); each command is a module of its own:

    ./launch.sh prune RUN_ID|CHECKPOINT layers=every_other [scale=train]   # pretrain/driver/prune.py
    ./launch.sh grow RUN_ID|CHECKPOINT depth=2x width=2x                    # pretrain/driver/grow.py
    ./launch.sh anneal RUN_ID|CHECKPOINT ...                                # pretrain/driver/anneal.py

``prune`` keeps a subset of the blocks; ``grow`` grows the model (the operators of ``pretrain/model/growth.py``, the
keys of a ``growth.schedule`` entry). Their checkpoint is written by this process through the checkpoint layer's
writer, as full weights (no DeepSpeed engine on the driver; without optimizer moments the resumed run starts a fresh
optimizer state, the reshaped model has other parameters); it resumes on any worker count and expert layout.
``anneal`` keeps the model, so its child carries the parent's engine state, AdamW moments included.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint import reader
from pretrain.checkpoint import weights as ckpt_weights
from pretrain.checkpoint.store import CheckpointError
from pretrain.checkpoint.writer import CheckpointWriter, Contents, EngineState, FullWeights, LocalWorld
from pretrain.config import ConfigError, RunConfig
from pretrain.config.paths import resolve_paths
from pretrain.data.fingerprint import fingerprints
from pretrain.driver.prepare import check_writable_dir, create_run, ended_on_error
from pretrain.driver.signals import stop_at_once
from pretrain.export.checkpoints import LoadedCheckpoint
from pretrain.train import tracking
from pretrain.train.callbacks.early_exit import EarlyExitCallback
from pretrain.train.job import FINGERPRINT_STATE


def derive_run(
    parent: LoadedCheckpoint,
    cfg: RunConfig,
    model: FullWeights | EngineState,
    tags: dict[str, Any],
    what: str,
    metrics: dict[str, float] | None = None,
    grown: bool = False,
    data: dict | None = None,
    checkpoint_dir: str | None = None,
) -> tuple[str, Path]:
    """Write ``model`` as the first checkpoint of a new run, child of the parent's run, continuing the parent's
    step, tokens and data position: full weights of ``cfg.model`` (and, when given, AdamW moments of those weights
    by name, see ``pretrain/checkpoint/weights.py``), written here without an engine and resumed on any worker count
    and expert layout; or the parent's own engine state (:func:`parent_engine_state`: the model is unchanged), then
    recorded as written by the parent's worker count (each rank's data file holds the whole data position, its RNG
    file the parent's rank's). ``grown``: the checkpoint records a growth at the parent's
    step, so the resumed run re-warms its LR over ``growth.rewarm_steps`` from there (the growth callback's state,
    as after an in-job growth). ``data``: another data position than the parent's (e.g. fresh streams of another
    mixture). ``checkpoint_dir``: where the new run's checkpoints go (default: the parent's ``checkpoint.dir``).
    Returns (run id, path)."""
    ckpt = dataclasses.replace(cfg.checkpoint, resume_from="")
    if checkpoint_dir:
        ckpt = dataclasses.replace(ckpt, dir=checkpoint_dir)
    track = cfg.tracking
    if track.run_name and track.run_name == parent.config.tracking.run_name:  # the MLflow name: the child's differs
        suffix = cfg.name.removeprefix(parent.config.name) if cfg.name != parent.config.name else f"-{what}"
        track = dataclasses.replace(track, run_name=track.run_name + suffix)
    cfg = resolve_paths(dataclasses.replace(cfg, checkpoint=ckpt, tracking=track))
    cfg.data.tokenizer = str(parent.tokenizer_dir())
    all_tags = {
        **{k: str(v) for k, v in tags.items()},
        "pretrain.derived": what,
        "pretrain.parent_checkpoint": str(parent.ckpt.path),
    }
    if parent.run_id:
        all_tags["mlflow.parentRunId"] = parent.run_id  # the MLflow UI nests the child under its parent
    check_writable_dir(cfg.checkpoint.dir, "checkpoint.dir")  # before the child run exists
    # The parent's data position is a position in the data the parent trained on: the child keeps that data's
    # fingerprint, so a resume of the child on changed data is refused as the parent's would be (data.allow_changed
    # to go on). Fresh streams (``data``) are of the data as it is now.
    raw = parent.trainer_state()
    recorded = (raw.get("callbacks") or {}).get(FINGERPRINT_STATE)
    data_fingerprint = recorded if data is None and recorded is not None else fingerprints(cfg.data)
    # a stop (Ctrl-C, SIGTERM) while the child is made ends the command at once and the child KILLED
    with stop_at_once():
        run_id, run_dir, uri = create_run(cfg, all_tags)
        with ended_on_error(uri, run_id):  # a failed or interrupted write ends the child FAILED or KILLED
            tracker = tracking.Tracker(uri, run_id)
            if metrics:
                tracker.log_metrics(metrics, parent.ckpt.step)
            state: dict[str, Any] = {
                "step": int(raw.get("step", parent.ckpt.step)),
                "tokens_seen": int(raw.get("tokens_seen", 0)),
                "sequences": int(raw.get("sequences", 0)),
                # the parent's, each stage at its size (not recounted at the child's)
                "flops": float(raw.get("flops", 0.0)),
                "last_train_loss": float("nan"),
            }
            # the data the child trains on (a resume of the child compares its sources with it)
            state["callbacks"] = {FINGERPRINT_STATE: data_fingerprint}
            window = (raw.get("callbacks") or {}).get(EarlyExitCallback.name)
            if window and "planned_steps" in window:  # the curriculum keeps the parent's plan: no exit the parent
                state["callbacks"][EarlyExitCallback.name] = {  # trains switches off (``gradual``) in the child
                    "trained": 0,
                    "steps": 0,
                    "planned_steps": int(window["planned_steps"]),
                }
            if grown:  # the parent's applied schedule entries stay applied; the growth happened at this step
                applied = (raw.get("callbacks") or {}).get("growth", {}).get("applied", [])
                state["callbacks"]["growth"] = {"applied": applied, "last_growth_step": state["step"]}
            world = LocalWorld()
            if isinstance(model, EngineState):  # one process writes the state of the parent's ranks
                world.world_size = parent.ckpt.manifest.world_size
            writer = CheckpointWriter(
                run_dir, world, run_id, keep_last=cfg.checkpoint.keep_last, register=tracker.register_checkpoint
            )
            data_state = data if data is not None else parent.data_position()  # the whole position, on every rank
            saved = [reader.read_rng_state(parent.ckpt.path, r) for r in range(world.world_size)]
            rngs = [rng or saved[0] or {"torch": torch.get_rng_state()} for rng in saved]
            others = {r: (data_state, rngs[r]) for r in range(1, world.world_size)}
            contents = Contents(cfg, state, data_state, model, rng_state=rngs[0], other_ranks=others)
            path = writer.save(contents)
            if writer.record_pending():  # the child's one checkpoint, not recorded: no run to resume by its id
                raise CheckpointError(f"{path} committed, but recording it in MLflow failed (above)")
        tracker.finish("FINISHED")
    return run_id, path


def parent_engine_state(parent: LoadedCheckpoint) -> EngineState | FullWeights:
    """The parent's model state unchanged, optimizer state included, for a child of the same model (``anneal``):
    its DeepSpeed engine files hard-linked (a committed checkpoint is never modified; copied where the filesystem
    cannot link) with the expert layout they were saved in (the child's ``parallel.expert`` may differ: its first
    training re-lays them out, as any resume does), or its full weights with their AdamW moments."""
    if reader.is_full_weights(parent.ckpt):
        return FullWeights(
            ckpt_weights.load_full_weights(parent.ckpt.path), ckpt_weights.load_optimizer_moments(parent.ckpt.path)
        )
    src = ckpt_weights.ds_engine_dir(parent.ckpt.path)

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    def save(directory: Path, on_file=None) -> list[Path]:  # the writer hashes the returned files
        shutil.copytree(src, directory, copy_function=link, dirs_exist_ok=True)
        return [p for p in directory.rglob("*") if p.is_file()]

    return EngineState(save, moe_ep_size=parent.ckpt.manifest.moe_ep_size)


def parse_options(argv: list[str], valid: set[str], usage: str) -> dict[str, str]:
    """The options of a derive command: ``argv[0]`` is the parent (a run id or a checkpoint directory), the rest
    ``key=value`` pairs with keys in ``valid``; ``usage`` names the command in the errors."""
    if not argv or "=" in argv[0]:
        raise ConfigError(f"{usage}: give a run id or a checkpoint directory first")
    opts = once_each([a.split("=", 1) for a in argv[1:] if "=" in a], usage)
    unknown = sorted(set(opts) - valid)
    if unknown or len(opts) != len(argv) - 1:
        raise ConfigError(f"{usage}: unknown option(s) {unknown or argv[1:]} (valid: {', '.join(sorted(valid))})")
    return opts


def once_each(pairs: list[list[str]], usage: str) -> dict[str, str]:
    """``key=value`` pairs (split at the first ``=``) as a dict of stripped keys; a key given twice is refused."""
    keys = [k.strip() for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ConfigError(f"{usage}: {', '.join(twice)} given more than once")
    return {k.strip(): v for k, v in pairs}


def step_option(opts: dict[str, str], usage: str) -> int | None:
    """The ``step=N`` option (a checkpoint step of the parent run); None when not given."""
    if "step" not in opts:
        return None
    if not (opts["step"].isascii() and opts["step"].isdigit()):
        raise ConfigError(f"{usage}: step={opts['step']}: not a checkpoint step (a whole number)")
    return int(opts["step"])
