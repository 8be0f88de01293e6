"""Committed checkpoints for export and evaluation, named the way a user names them: a checkpoint directory, a run
directory (its latest, or ``--step``) or an MLflow run id (resolved through the tracking store). Reading the
checkpoint (config, tokenizer, merged full weights) is the checkpoint layer's (``pretrain/checkpoint/reader.py``)."""

from __future__ import annotations

from pathlib import Path

from pretrain.checkpoint.reader import LoadedCheckpoint, find_checkpoint, latest_verified, load, pick_step
from pretrain.checkpoint.weights import consolidated_state_dict, strip_module_prefix
from pretrain.config import ConfigError

__all__ = ["LoadedCheckpoint", "consolidated_state_dict", "resolve_checkpoint", "strip_module_prefix"]


def resolve_checkpoint(target: str, step: int | None = None) -> LoadedCheckpoint:
    """A checkpoint dir, a run dir (latest or ``step``) or an MLflow run id -> verified checkpoint."""
    from pretrain.train import tracking

    path = Path(target).expanduser()
    run_id: str | None = None
    if path.exists():
        ckpt = find_checkpoint(path, step)
        candidate = ckpt.manifest.run_id
        if candidate and not candidate.startswith(tracking.LOCAL_RUN_PREFIX):
            run_id = candidate if tracking.find_run(tracking.tracking_uri(), candidate) is not None else None
    elif tracking.names_a_path(target):
        raise ConfigError(f"{target}: no such checkpoint or run directory")
    else:
        root = tracking.run_checkpoint_root(tracking.tracking_uri(), target)
        ckpt = pick_step(Path(root), step) if step is not None else latest_verified(Path(root), target)
        run_id = target
    return load(ckpt, run_id)
