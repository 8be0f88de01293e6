"""Atomic checkpoints: every rank writes into a temporary directory, rank 0 verifies, checksums,
writes ``manifest.json``, fsyncs and renames to ``step_NNNNNNNN``. Only directories with a valid
manifest are "committed"; resume, listing and MLflow registration only ever see committed ones.

Layout of one committed checkpoint::

    step_00000100/
      manifest.json          step, tokens, config hash, data position, metrics, file checksums
      config.yaml            the resolved config
      trainer_state.json     loop counters (step, tokens seen, last metrics)
      data/rank_R.json       each rank's data stream state (union = the global data position)
      rng/rank_R.pt          each rank's torch RNG state
      tokenizer/             the run's tokenizer (so a checkpoint is self-contained for export)
      ds/state/...           DeepSpeed engine state (model, optimizer shards per rank)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain import ds_adapter

MANIFEST = "manifest.json"
DS_DIR = "ds"
DS_TAG = "state"
_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems (and Windows) cannot fsync a directory
        pass


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def staging_dir(run_dir: Path, step: int, nonce: str) -> Path:
    """Temporary directory for the checkpoint of ``step``; ``nonce`` must be the same on all ranks."""
    return run_dir / f".tmp-{step_dir_name(step)}-{nonce}"


def new_nonce() -> str:
    return uuid.uuid4().hex[:12]


def save_rank_state(stage: Path, rank: int, data_state: dict, rng_state: dict[str, torch.Tensor]) -> None:
    """Per-rank files: data position and RNG state."""
    write_json(stage / "data" / f"rank_{rank}.json", data_state)
    (stage / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state, stage / "rng" / f"rank_{rank}.pt")


def commit(stage: Path, run_dir: Path, step: int, manifest: dict, world_size: int) -> Path:
    """Rank 0 only, after a barrier: verify the staged files, checksum, write the manifest, rename."""
    missing = [f"data/rank_{r}.json" for r in range(world_size) if not (stage / "data" / f"rank_{r}.json").is_file()]
    if not (stage / DS_DIR / DS_TAG).is_dir():
        missing.append(f"{DS_DIR}/{DS_TAG}/")
    if missing:
        raise CheckpointError(f"{stage}: incomplete checkpoint, missing {', '.join(missing)}")
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        _fsync_file(path)
        files[path.relative_to(stage).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    for d in sorted({p.parent for p in stage.rglob("*")} | {stage}):
        _fsync_dir(d)
    manifest = {**manifest, "step": step, "world_size": world_size, "files": files,
                "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(stage / MANIFEST, manifest)
    _fsync_file(stage / MANIFEST)
    final = run_dir / step_dir_name(step)
    if final.exists():  # a re-run of the same step (e.g. after a restart): replace atomically-ish
        trash = run_dir / f".old-{step_dir_name(step)}-{new_nonce()}"
        os.replace(final, trash)
        os.replace(stage, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(stage, final)
    _fsync_dir(run_dir)
    return final


@dataclass(frozen=True)
class CommittedCheckpoint:
    path: Path
    step: int
    manifest: dict


def read_manifest(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a committed checkpoint (no {MANIFEST})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}/{MANIFEST}: corrupt manifest ({e})") from None


def verify(path: Path, manifest: dict | None = None) -> None:
    """Check every file listed in the manifest exists with the recorded size and checksum."""
    manifest = manifest or read_manifest(path)
    for rel, meta in manifest["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: missing file {rel}")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch for {rel}")


def verify_or_point_back(ckpt: CommittedCheckpoint) -> None:
    """:func:`verify` ``ckpt``; when it fails, the error also names the newest older checkpoint of the same run
    directory that verifies, and how to resume from it (a new run starting from that checkpoint)."""
    try:
        verify(ckpt.path, ckpt.manifest)
    except CheckpointError as e:
        older = [c for c in list_committed(ckpt.path.parent) if c.step < ckpt.step]
        for candidate in reversed(older):
            try:
                verify(candidate.path, candidate.manifest)
            except CheckpointError:
                continue
            raise CheckpointError(f"{e}; the newest checkpoint that verifies is step {candidate.step}: resume from it "
                                  f"with ./launch.sh resume {candidate.path}") from None
        raise CheckpointError(f"{e}; no older checkpoint of this run verifies") from None


def list_committed(run_dir: Path) -> list[CommittedCheckpoint]:
    """Committed checkpoints of a run directory, oldest first (staging dirs are ignored)."""
    out = []
    if not run_dir.is_dir():
        return out
    for child in run_dir.iterdir():
        m = _STEP_RE.match(child.name)
        if m and (child / MANIFEST).is_file():
            try:
                out.append(CommittedCheckpoint(child, int(m.group(1)), read_manifest(child)))
            except CheckpointError:
                continue
    return sorted(out, key=lambda c: c.step)


def latest_committed(run_dir: Path) -> CommittedCheckpoint | None:
    found = list_committed(run_dir)
    return found[-1] if found else None


def resolve(path: Path) -> CommittedCheckpoint:
    """A checkpoint dir, or a run dir (-> its latest committed checkpoint), verified."""
    path = path.resolve()
    if (path / MANIFEST).is_file():
        manifest = read_manifest(path)
        ckpt = CommittedCheckpoint(path, int(manifest["step"]), manifest)
    else:
        ckpt = latest_committed(path)
        if ckpt is None:
            raise CheckpointError(f"{path}: no committed checkpoint found")
    verify_or_point_back(ckpt)
    return ckpt


def cleanup_staging(run_dir: Path) -> None:
    """Remove leftovers of interrupted saves (rank 0, at start)."""
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            if child.name.startswith((".tmp-step_", ".old-step_", ".tmp-universal-")):
                shutil.rmtree(child, ignore_errors=True)


def prune(run_dir: Path, keep_last: int, protect: set[str] = frozenset()) -> None:
    """Delete committed checkpoints beyond the newest ``keep_last`` (0 keeps all), never one in ``protect``."""
    if keep_last <= 0:
        return
    for ckpt in list_committed(run_dir)[:-keep_last]:
        if str(ckpt.path) not in protect:
            shutil.rmtree(ckpt.path, ignore_errors=True)


def load_rank_state(ckpt: Path, rank: int) -> tuple[dict, dict | None]:
    """(merged data state of all ranks, this rank's RNG state or None if the world size changed)."""
    from pretrain.data import merge_states  # the data package is heavy to import; only resumes need it

    merged = merge_states([json.loads(f.read_text()) for f in sorted((ckpt / "data").glob("rank_*.json"))])
    rng_file = ckpt / "rng" / f"rank_{rank}.pt"
    rng = torch.load(rng_file, weights_only=True) if rng_file.is_file() else None
    return merged, rng


def universal_checkpoint(ckpt: CommittedCheckpoint, cache_root: Path) -> Path:
    """DeepSpeed universal form of ``ckpt`` (for resuming with a different worker count), converted once
    and cached under ``cache_root``; staged and renamed so an interrupted conversion is never used.
    Returns the directory to pass to ``engine.load_checkpoint(..., tag=DS_TAG)``."""
    final = cache_root / f"universal-{step_dir_name(ckpt.step)}"
    if (final / DS_TAG).is_dir():
        return final
    stage = cache_root / f".tmp-universal-{step_dir_name(ckpt.step)}-{new_nonce()}"
    ds_adapter.convert_to_universal(ckpt.path / DS_DIR / DS_TAG, stage / DS_TAG)
    os.replace(stage, final)
    _fsync_dir(cache_root)
    return final
