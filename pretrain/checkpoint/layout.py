"""The on-disk layout of a run directory and of one committed checkpoint: every file and directory name, here
and nowhere else (``tests/unit/checkpoint/test_layout.py`` fails when one is spelled outside this package).

A run directory (``checkpoint.dir / RUN_ID``)::

    config.yaml              the run's resolved config (written at run creation)
    tokenizer/               the run's tokenizer
    init_weights.pt          ``model.init_from_hf`` weights converted by the driver (when set)
    summary.json             the end-of-run summary
    stop_request.json        a stop asked for by the driver (a signal, ``stop JOB``); present only while it stops
    halt.json                a stability halt under Ray, for the driver (not a failure Ray Train would retry);
                             present only until the driver reads it
    step_NNNNNNNN/           committed checkpoints (below)
    .tmp-step_NNNNNNNN-X/    a save in progress (never read; removed at the next start)
    .prev-step_NNNNNNNN-X/   a checkpoint set aside while a re-run of its step commits (put back at the next start
                             when the step has no directory: the commit was interrupted)
    universal-step_N-KEY/    a checkpoint's DeepSpeed universal form (resumed on another worker count)
    full-step_N-KEY/         a checkpoint's full form (resumed on another expert-parallel layout); both removed at a
                             job's start once their checkpoint is gone (``conversions.remove_stale``)

One committed checkpoint::

    step_00000100/
      manifest.json          the typed manifest (``manifest.Manifest``): step, counters, format, file checksums
      config.yaml            the resolved config as of this step (growth may have changed the architecture)
      trainer_state.json     loop counters and the callbacks' state
      data/rank_R.json       each rank's data stream state (union = the global data position)
      rng/rank_R.pt          each rank's torch RNG state
      tokenizer/             the run's tokenizer (so a checkpoint is self-contained for export)
      ds/state/...           format "deepspeed": the DeepSpeed engine state (model, optimizer shards per rank)
      weights.safetensors    format "full": the full model weights (fp32, our parameter names)
      optimizer.safetensors  format "full", optional: AdamW moments by parameter name (see ``weights.py``)
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST = "manifest.json"
CONFIG = "config.yaml"
TRAINER_STATE = "trainer_state.json"
TOKENIZER = "tokenizer"
DATA_DIR = "data"
RNG_DIR = "rng"
DS_DIR = "ds"
DS_TAG = "state"
WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.safetensors"

# Run-directory entries beside the checkpoints.
RUN_CONFIG = CONFIG
RUN_TOKENIZER = TOKENIZER
INIT_WEIGHTS = "init_weights.pt"
SUMMARY = "summary.json"
STOP_REQUEST = "stop_request.json"
HALT = "halt.json"
ABANDONED = "abandoned"

STEP_PREFIX = "step_"
STAGING_PREFIX = ".tmp-"
REPLACED_PREFIX = ".old-"
SUPERSEDED_PREFIX = ".prev-"
UNIVERSAL_PREFIX = "universal-"
RESHARDED_PREFIX = "full-"
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d{{8}})$")
_SUPERSEDED_RE = re.compile(rf"^{re.escape(SUPERSEDED_PREFIX)}{STEP_PREFIX}(\d{{8}})-\w+$")
_CONVERSION_RE = re.compile(rf"^(?:{UNIVERSAL_PREFIX}|{RESHARDED_PREFIX}){STEP_PREFIX}(\d{{8}})(?:-(\w+))?$")


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a committed checkpoint directory's name, or None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def superseded_step_of(name: str) -> int | None:
    """The step of a :func:`superseded_dir` name, or None for any other name."""
    m = _SUPERSEDED_RE.match(name)
    return int(m.group(1)) if m else None


def data_file(rank: int) -> str:
    """Relative path of rank ``rank``'s data position."""
    return f"{DATA_DIR}/rank_{rank}.json"


def rng_file(rank: int) -> str:
    """Relative path of rank ``rank``'s RNG state."""
    return f"{RNG_DIR}/rank_{rank}.pt"


DATA_GLOB = "rank_*.json"
RNG_PATTERN = rng_file(0).replace("0", "R")  # documented in the manifest


def staging_dir(run_dir: Path, step: int, nonce: str) -> Path:
    """Temporary directory for the checkpoint of ``step``; ``nonce`` must be the same on all ranks."""
    return run_dir / f"{STAGING_PREFIX}{step_dir_name(step)}-{nonce}"


def replaced_dir(run_dir: Path, step: int, nonce: str) -> Path:
    """Where a pruned checkpoint goes until it is deleted (possibly half-deleted: never read again)."""
    return run_dir / f"{REPLACED_PREFIX}{step_dir_name(step)}-{nonce}"


def superseded_dir(run_dir: Path, step: int, nonce: str) -> Path:
    """Where a committed checkpoint waits while a re-run of its step renames the new one into its place; deleted
    once that is done, put back if the new one never arrived (``store.restore_superseded``)."""
    return run_dir / f"{SUPERSEDED_PREFIX}{step_dir_name(step)}-{nonce}"


def universal_dir(cache_root: Path, step: int, key: str) -> Path:
    """The DeepSpeed universal form of the checkpoint of ``step`` whose manifest hashes to ``key``
    (``weights.universal_checkpoint``): another checkpoint of the same step (after a rollback) has another key."""
    return cache_root / f"{UNIVERSAL_PREFIX}{step_dir_name(step)}-{key}"


def universal_staging_dir(cache_root: Path, step: int, nonce: str) -> Path:
    return cache_root / f"{STAGING_PREFIX}{UNIVERSAL_PREFIX}{step_dir_name(step)}-{nonce}"


def resharded_dir(cache_root: Path, step: int, key: str) -> Path:
    """The full form (weights and moments) of the checkpoint of ``step`` whose manifest hashes to ``key``, converted
    for another expert-parallel layout (``reader.resharded_full_form``)."""
    return cache_root / f"{RESHARDED_PREFIX}{step_dir_name(step)}-{key}"


def conversion_of(name: str) -> tuple[int, str] | None:
    """(step, manifest key) of a cached conversion's directory name (:func:`universal_dir`, :func:`resharded_dir`;
    key '' for a name without one), or None for any other name."""
    m = _CONVERSION_RE.match(name)
    return (int(m.group(1)), m.group(2) or "") if m else None


def resharded_staging_dir(cache_root: Path, step: int, nonce: str) -> Path:
    return cache_root / f"{STAGING_PREFIX}{RESHARDED_PREFIX}{step_dir_name(step)}-{nonce}"


def discarded_dir(run_dir: Path, name: str, nonce: str) -> Path:
    """Where a cached conversion named ``name`` goes until it is deleted (``conversions.remove_stale``)."""
    return run_dir / f"{REPLACED_PREFIX}{name}-{nonce}"


LEFTOVER_PREFIXES = (
    f"{STAGING_PREFIX}{STEP_PREFIX}",
    f"{REPLACED_PREFIX}{STEP_PREFIX}",
    f"{REPLACED_PREFIX}{UNIVERSAL_PREFIX}",
    f"{REPLACED_PREFIX}{RESHARDED_PREFIX}",
    f"{SUPERSEDED_PREFIX}{STEP_PREFIX}",
    f"{STAGING_PREFIX}{UNIVERSAL_PREFIX}",
    f"{STAGING_PREFIX}{RESHARDED_PREFIX}",
    f"{STAGING_PREFIX}{RUN_TOKENIZER}-",
)
"""Names of interrupted saves and conversions, removed by rank 0 at the start of a job (after a superseded checkpoint
whose step has no directory is put back)."""
