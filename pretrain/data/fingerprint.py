"""Fingerprints of a run's data sources, so that a resume notices data that changed under it.

Every source of ``data.sources`` and ``data.val_sources`` is recorded per file: its size, its modification time and
the sha256 of sampled blocks (the first, the last and evenly spaced ones between: a fixed read per file, whatever
its size). A hub dataset is recorded by name, split and revision (the ``@revision`` of its path, when pinned). A
directory of token shards is recorded by its manifest and every file the manifest lists (a re-tokenized or
rewritten shard is a change).
The driver fingerprints the sources when a run starts or resumes; every checkpoint keeps the fingerprint its run
trained on (``trainer_state.json``), and a resume compares it with the sources as they are
(:func:`differences`). Size and sampled content decide; the modification time alone (a copy, a ``touch``) does not.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pretrain.config import ConfigError, DataConfig, SourceConfig
from pretrain.config.errors import clip, without_passwords
from pretrain.data.file_hash import BLOCK, BLOCKS, file_fingerprint  # noqa: F401 - the sampling, re-exported
from pretrain.data.sources import resolve_source


def source_fingerprint(src: SourceConfig, cache_dir: str) -> dict[str, Any]:
    resolved = resolve_source(src, cache_dir)
    if resolved.format == "hub":
        return {"hub": resolved.hub_path, "split": src.split, "revision": resolved.revision or "unpinned"}
    if resolved.format == "shards":  # the manifest and every file it lists
        from pretrain.data.shards.format import MANIFEST, load_manifest

        d = resolved.files[0]
        m = load_manifest(d)
        names = [MANIFEST, *(r.file for r in m.index), *(r.file for r in m.shards)]
        return {"files": {os.path.join(d, n): file_fingerprint(os.path.join(d, n)) for n in names}}
    return {"files": {f: file_fingerprint(f) for f in resolved.files}}


def fingerprints(cfg: DataConfig) -> dict[str, Any]:
    """``data.sources[i]`` / ``data.val_sources[i]`` -> that source's fingerprint."""
    out: dict[str, Any] = {}
    for key, group in (("data.sources", cfg.sources), ("data.val_sources", cfg.val_sources)):
        for i, src in enumerate(group):
            out[f"{key}[{i}]"] = {"path": src.path, **source_fingerprint(src, cfg.cache_dir)}
    return out


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """How the sources changed from ``recorded`` to ``current``, one phrase each; empty when they did not."""
    out: list[str] = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key), current.get(key)
        if old is None or new is None:
            out.append(f"{key} {'added' if old is None else 'removed'}")
            continue
        if old.get("path") != new.get("path"):
            before, after = (clip(without_passwords(str(s.get("path")))) for s in (old, new))
            out.append(f"{key}.path {before} -> {after}")
            continue
        if "hub" in old or "hub" in new:
            if {k: old.get(k) for k in ("hub", "split", "revision")} != {
                k: new.get(k) for k in ("hub", "split", "revision")
            }:
                out.append(
                    without_passwords(
                        f"{key}: hub dataset {old.get('hub')}@{old.get('revision')} -> "
                        f"{new.get('hub')}@{new.get('revision')}"
                    )
                )
            continue
        out.extend(_file_changes(key, old.get("files", {}), new.get("files", {})))
    return out


def _file_changes(key: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a is None or b is None:
            out.append(f"{key}: {clip(path)} {'appeared' if a is None else 'is gone'}")
        elif a["size"] != b["size"]:
            out.append(f"{key}: {clip(path)} size {a['size']:,} -> {b['size']:,} bytes (modified {_when(b['mtime'])})")
        elif a["sampled_sha256"] != b["sampled_sha256"]:
            out.append(f"{key}: {clip(path)} content changed, same size (modified {_when(b['mtime'])})")
    return out


def _when(mtime: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))


def check_unchanged(recorded: dict[str, Any] | None, cfg: DataConfig, checkpoint: str) -> dict[str, Any]:
    """The sources' fingerprint now; raises a one-line :class:`ConfigError` when they differ from ``recorded`` (the
    fingerprint a checkpoint kept) unless ``data.allow_changed``. A checkpoint without one is not compared."""
    current = fingerprints(cfg)
    changed = differences(recorded, current) if recorded is not None else []
    if changed and not cfg.allow_changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise ConfigError(
            f"data changed since checkpoint {checkpoint}: {changed[0]}{more}; the resumed run would repeat or skip "
            "data. Restore the data, or resume anyway with data.allow_changed=true (recorded in MLflow)"
        )
    return current
