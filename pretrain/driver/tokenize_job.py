"""What a tokenize job is (``./launch.sh tokenize``, :mod:`pretrain.driver.tokenize`): the spec its output
depends on, recorded in ``--out`` before anything else (``.work/job.json``) and in the finished manifest, so that a
rerun of the same command resumes the job or answers "done already", and another job's directory is refused
(:func:`check_out`, :func:`same_job`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pretrain.config import ConfigError, DataConfig
from pretrain.config.errors import clip
from pretrain.data.shards.format import is_shard_dir

WORK_DIR = ".work"
JOB_FILE = "job.json"


def check_out(out: Path) -> None:
    """``--out`` is new, empty, or a tokenize output: finished (a token-shard manifest) or not (the job file an
    earlier job wrote first, :func:`is_job_dir`). Anything else is refused: the job replaces files in it."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"tokenize --out: {clip(str(out))} is not a directory")
    if out.is_dir() and any(out.iterdir()) and not is_shard_dir(out) and not is_job_dir(out):
        raise ConfigError(
            f"tokenize --out: {clip(str(out))} is not empty and holds neither token shards nor an unfinished tokenize "
            "job; give a new one (nothing was changed)"
        )


def is_job_dir(out: Path) -> bool:
    """``out`` holds the job file of a tokenize job (``.work/job.json``: an object naming its sources and
    tokenizer), not merely a directory named ``.work``."""
    try:
        raw = json.loads((out / WORK_DIR / JOB_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and {"sources", "tokenizer_sha256"} <= raw.keys()


def job_spec(
    a: argparse.Namespace, cfg: DataConfig, sources, tok_hash: str, recorded: dict | None = None
) -> dict[str, Any]:
    """What the output depends on (a rerun must match it). Each file's whole sha256 (an edit in place that keeps its
    size counts), taken from ``recorded`` (the job's spec as written) for a file of the same size, modification time
    and sampled hash: a rerun reads again only what changed."""
    from pretrain.data.file_hash import full_sha256
    from pretrain.data.fingerprint import source_fingerprint

    known = {
        name: f
        for src in (recorded or {}).get("sources", [])
        for name, f in (src.get("fingerprint") or {}).get("files", {}).items()
        if isinstance(f, dict) and "sha256" in f
    }

    def fingerprint(src) -> dict[str, Any]:
        fp = source_fingerprint(src, cfg.cache_dir)
        for name, f in fp.get("files", {}).items():
            was = known.get(name, {})
            same = all(was.get(k) == f[k] for k in ("size", "mtime", "sampled_sha256"))
            f["sha256"] = was["sha256"] if same else full_sha256(name)
        return fp

    return {
        "sources": [
            {"path": s.path, "text_field": s.text_field, "fingerprint": fingerprint(s)}
            | ({"format": s.format} if s.format != "auto" else {})  # (no key for auto: as jobs before --format)
            for s in cfg.sources
        ],
        "tokenizer_sha256": tok_hash,
        "shard_tokens": a.shard_tokens,
        "chunk_bytes": a.chunk_bytes,
        # a BPE trained for the job: the size asked for (an unfinished job's tokenizer is reused, not trained again)
        **({} if a.tokenizer else {"tokenizer_vocab_size": a.vocab_size}),
        # and what else it was trained from, where --config set it (no key otherwise: as jobs before --config)
        **({"tokenizer_data": tokenizer_data(cfg)} if a.config and not a.tokenizer else {}),
    }


def tokenizer_data(cfg: DataConfig) -> dict:
    """What a BPE trained for the job depends on besides the sources and its size (as its cache key does)."""
    return {
        "train_docs": cfg.tokenizer_train_docs,
        "val_holdout": cfg.val_holdout if not cfg.val_sources else 0.0,
    }


def read_job(job_file: Path) -> dict | None:
    """The spec an unfinished job recorded (None: none, or unreadable)."""
    try:
        raw = json.loads(job_file.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def same_job(recorded: dict, spec: dict) -> bool:
    """Specs equal, a file's modification time aside (a copy or a ``touch`` changes no token); a job recorded
    before files had their whole sha256 in the spec is compared by their sampled one."""
    files = [f for src in recorded.get("sources", []) for f in src.get("fingerprint", {}).get("files", {}).values()]
    ignore = {"mtime"} if all("sha256" in f for f in files) else {"mtime", "sha256"}

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ignore}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    if "tokenizer_vocab_size" not in recorded:  # a job recorded before the key: its tokenizer's hash says enough
        spec = {k: v for k, v in spec.items() if k != "tokenizer_vocab_size"}
    return strip(recorded) == strip(spec)
