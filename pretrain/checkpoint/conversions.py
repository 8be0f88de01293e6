"""Conversions of a checkpoint cached in its run directory (the DeepSpeed universal form for another worker count,
``weights.universal_checkpoint``; the full form for another expert-parallel layout, ``reader.resharded_full_form``):
their key, their durable publication, and their removal once the checkpoint they were made from is gone."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from pretrain.checkpoint import layout
from pretrain.checkpoint.store import CommittedCheckpoint, fsync_dir, fsync_file, list_committed, new_nonce


def manifest_key(ckpt: CommittedCheckpoint) -> str:
    """A short hash of ``ckpt``'s manifest (its files' checksums, its commit time): what a conversion cached for it is
    keyed by, so another checkpoint of the same step (committed after a rollback) never reuses it."""
    return hashlib.sha256((ckpt.path / layout.MANIFEST).read_bytes()).hexdigest()[:12]


def publish(stage: Path, final: Path) -> Path:
    """Rename a finished conversion from ``stage`` to ``final`` once its files and directories are on disk, so that a
    crash (or a power loss) leaves either no ``final`` or a whole one."""
    for root, dirs, files in os.walk(stage, topdown=False):
        for name in files:
            fsync_file(Path(root) / name)
        for name in dirs:
            fsync_dir(Path(root) / name)
    fsync_dir(stage)
    os.replace(stage, final)
    fsync_dir(final.parent)
    return final


def remove_stale(run_dir: Path, keep: CommittedCheckpoint | None = None) -> list[str]:
    """Remove the cached conversions whose checkpoint is no longer there: pruned, rolled back, replaced by another
    checkpoint of its step (another manifest key), or of a version that named them without a key. ``keep``: a
    checkpoint outside the run whose conversions stay too (``checkpoint.resume_from``: another run's). Each is renamed
    out of sight first (a leftover name, removed at the next start if the deletion is cut short), so a half-deleted
    conversion is never found. Rank 0, at the start of a job (no conversion is being made or read then). Returns the
    names removed."""
    if not run_dir.is_dir():
        return []
    live = {(c.step, manifest_key(c)) for c in [*list_committed(run_dir), *([keep] if keep else [])]}
    gone = []
    for child in run_dir.iterdir():
        made_from = layout.conversion_of(child.name)
        if made_from is not None and made_from not in live and child.is_dir():
            trash = layout.discarded_dir(run_dir, child.name, new_nonce())
            os.replace(child, trash)
            shutil.rmtree(trash, ignore_errors=True)
            gone.append(child.name)
    return sorted(gone)
