"""Local paths of a config made absolute on the driver (workers do not share its working directory)."""

from __future__ import annotations

import os
from pathlib import Path

from pretrain.config.evaluation import BUILTIN_TASK
from pretrain.config.tree import RunConfig


def absolute(path: str, base: Path) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded, made absolute against ``base`` (empty and absolute paths
    unchanged)."""
    path = os.path.expanduser(path)
    return str((base / path).resolve()) if path and not Path(path).is_absolute() else path


def resolve_paths(cfg: RunConfig, base: Path | None = None) -> RunConfig:
    """Make every local path absolute (workers do not share the driver's working directory), ``~`` expanded."""
    base = base or Path.cwd()
    c = cfg
    c.checkpoint.dir = absolute(c.checkpoint.dir, base)
    c.checkpoint.resume_from = absolute(c.checkpoint.resume_from, base)
    c.data.cache_dir = absolute(c.data.cache_dir, base)
    c.data.tokenizer = absolute(c.data.tokenizer, base)
    c.model.init_from_hf = absolute(c.model.init_from_hf, base)
    c.eval.tasks = [t if t == BUILTIN_TASK else absolute(t, base) for t in c.eval.tasks]
    for src in [*c.data.sources, *c.data.val_sources]:
        if src.path != "demo" and src.format != "hub" and "://" not in src.path:
            src.path = os.path.expanduser(src.path)
            candidate = base / src.path
            exists = os.path.exists(candidate)  # (Path.exists raises on a name too long)
            if not Path(src.path).is_absolute() and (exists or any(ch in src.path for ch in "*?[")):
                src.path = str(candidate.resolve()) if exists else str(base / src.path)
    return c
