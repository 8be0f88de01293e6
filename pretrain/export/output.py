"""The export's output directory: nothing the user wrote there is deleted or overwritten.

An export is written into a staging directory next to ``--out`` and verified there (:mod:`pretrain.export.hf`);
:func:`commit` then moves it in. ``--out`` may be

* a new (or empty) directory: the staging dir is renamed to it (or its files are moved in);
* an earlier export: only the files that export wrote are replaced, and those of its files the new export does
  not write are removed. Which files these are is recorded in :data:`MANIFEST_FILE` (name, size, sha256); every
  other file in the directory is left alone.

Refused, in one line (:class:`ConfigError`), before anything in ``--out`` changes: a non-empty directory without a
manifest (not an export of ours, or one written before manifests existed); a file of the earlier export that was
changed since (its sha256 differs from the manifest); a file the new export would write that the earlier export did
not; and new weights into a directory that an MLflow logged model or registered model version records by path
(re-exporting byte-identical files there is allowed: what MLflow points at stays the same).

Written files get the permissions of files the user creates (``0o666 & ~umask``), not the ``0o600`` of the
temporary files ``transformers`` writes shards through. Each file is replaced with ``os.replace`` (atomic); the
manifest lists old and new hashes while files are moved, so an interrupted commit still leaves a directory whose
files are all accounted for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from pretrain.checkpoint.store import fsync_dir
from pretrain.config import ConfigError

MANIFEST_FILE = "pretrain_export_manifest.json"
MANIFEST_FORMAT = 1
_REDO = "pick another --out, or empty the directory"


@dataclass
class Earlier:
    """The manifest of an earlier export: its files (name -> (size, sha256)); during an interrupted commit also
    the files being moved in (``pending``); and the MLflow records that name the directory. ``present``: those of
    its files that are there now, as they are (filled by :func:`check_out` with ``hashes``)."""

    files: dict[str, tuple[int, str]] = field(default_factory=dict)
    pending: dict[str, tuple[int, str]] = field(default_factory=dict)
    referenced_by: list[dict[str, Any]] = field(default_factory=list)
    present: dict[str, tuple[int, str]] = field(default_factory=dict)

    def ours(self, name: str) -> bool:
        return name in self.files or name in self.pending

    def accepts(self, name: str, size: int, sha: str | None) -> bool:
        """Whether a file of this size (and sha256, when given) is one this export wrote."""
        return any(e[0] == size and sha in (None, e[1]) for e in (self.files.get(name), self.pending.get(name)) if e)


def _entries(raw: Any) -> dict[str, tuple[int, str]]:
    if not isinstance(raw, dict):
        raise ValueError("files is not an object")
    entries = {}
    for name, e in raw.items():
        p = PurePosixPath(name)
        if p.is_absolute() or not p.parts or ".." in p.parts or str(p) != name:
            raise ValueError(f"file name {name!r} is not inside the directory")
        entries[name] = (int(e["size"]), str(e["sha256"]))
    return entries


def read_manifest(out: Path) -> Earlier | None:
    """The manifest of the export in ``out``; None when there is none; ConfigError when it is unreadable."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {MANIFEST_FORMAT}")
        refs = raw.get("referenced_by", [])
        if not isinstance(refs, list) or not all(isinstance(r, dict) for r in refs):
            raise ValueError("referenced_by is not a list of objects")
        return Earlier(_entries(raw.get("files", {})), _entries(raw.get("pending", {})), refs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--out {out}: its {MANIFEST_FILE} is unreadable ({e}); {_REDO}") from None


def _sha256(path: Path, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        if fsync:  # the staged file reaches the disk before it replaces anything
            os.fsync(f.fileno())
    return h.hexdigest()


def _changed(out: Path, earlier: Earlier, *, hashes: bool) -> str | None:
    """The first file of the earlier export that was changed since (size, and sha256 when ``hashes``)."""
    for name in sorted(set(earlier.files) | set(earlier.pending)):
        p = out / name
        if not p.exists() and not p.is_symlink():
            continue  # removed by the user: nothing to keep
        if not p.is_file():
            return name
        size = p.stat().st_size
        sha = _sha256(p) if hashes and earlier.accepts(name, size, None) else None
        if not earlier.accepts(name, size, sha):
            return name
        if sha is not None:
            earlier.present[name] = (size, sha)
    return None


def check_out(out: Path, *, hashes: bool = False) -> Earlier | None:
    """Refuse (ConfigError, one line) an ``out`` that export must not write into; returns the earlier export's
    manifest (None: a new or empty directory). Without ``hashes`` changed files are found by size only (cheap,
    before the work); :func:`commit` checks sha256."""
    out = out.expanduser().resolve()
    if not out.exists():
        parent = next(p for p in out.parents if p.exists())  # the nearest that exists ("/" at the last)
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            what = "is not a directory" if not parent.is_dir() else "is not writable"
            raise ConfigError(f"--out {out}: {parent} {what}, so the export cannot be made there; pick another --out")
        return None
    if not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory; pick another --out")
    earlier = read_manifest(out)
    if earlier is None:
        if any(out.iterdir()):
            raise ConfigError(f"--out {out}: not empty and not an earlier export (no {MANIFEST_FILE}); {_REDO}")
        return None
    name = _changed(out, earlier, hashes=hashes)
    if name is not None:
        raise ConfigError(
            f"--out {out}: {name} was changed since the earlier export wrote it; export does not overwrite it "
            f"(move it away or {_REDO})"
        )
    return earlier


def staging_dir(out: Path) -> Path:
    """A fresh staging directory next to ``out`` (after :func:`check_out`)."""
    out = out.expanduser().resolve()
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    return stage


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it portably; set back at once
    os.umask(mask)
    return mask


def describe_reference(ref: dict[str, Any]) -> str:
    if "registered_model" in ref:
        version = f" version {ref['version']}" if ref.get("version") is not None else ""
        return f"registered model {ref['registered_model']}{version}"
    model = f" {ref['logged_model']}" if ref.get("logged_model") else ""
    return f"logged model{model} of MLflow run {ref.get('mlflow_run')}"


def _write_manifest(dest: Path, tmp_dir: Path, files: dict, pending: dict, refs: list[dict[str, Any]]) -> None:
    """Write the manifest to ``dest`` atomically (through ``tmp_dir``, on the same file system)."""

    def entries(d: dict[str, tuple[int, str]]) -> dict[str, dict[str, Any]]:
        return {k: {"size": s, "sha256": h} for k, (s, h) in sorted(d.items())}

    body: dict[str, Any] = {"format": MANIFEST_FORMAT, "files": entries(files)}
    if pending:
        body["pending"] = entries(pending)
    body["referenced_by"] = refs
    tmp = tmp_dir / f".{MANIFEST_FILE}.{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(json.dumps(body, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, dest)


def commit(stage: Path, out: Path, *, referenced_by: list[dict[str, Any]] | None = None) -> Path:
    """Move the verified export in ``stage`` into ``out`` (module doc) and remove ``stage``; returns ``out``."""
    out = out.expanduser().resolve()
    mode = 0o666 & ~_umask()
    new: dict[str, tuple[int, str]] = {}
    for p in sorted(stage.rglob("*")):
        if p.is_file():
            os.chmod(p, mode)
            new[p.relative_to(stage).as_posix()] = (p.stat().st_size, _sha256(p, fsync=True))
    refs = list(referenced_by or [])
    earlier = check_out(out, hashes=True)
    if not out.exists():
        _write_manifest(stage / MANIFEST_FILE, stage, new, {}, refs)
        stage.rename(out)
        fsync_dir(out.parent)
        return out
    earlier = earlier or Earlier()
    for name in sorted(new):
        target = out / name
        if (target.exists() or target.is_symlink()) and not earlier.ours(name):
            raise ConfigError(f"--out {out}: {name} was not written by an earlier export; export does not overwrite it")
    if earlier.referenced_by and new != earlier.files:
        raise ConfigError(
            f"--out {out}: the export there is {describe_reference(earlier.referenced_by[0])}, which records the "
            f"directory by path; other weights there would change what it points to (pick another --out)"
        )
    refs = earlier.referenced_by + [r for r in refs if r not in earlier.referenced_by]
    # Interrupted from here on, every file is as it was (``files``) or as it will be (``pending``).
    _write_manifest(out / MANIFEST_FILE, stage, earlier.present, new, refs)
    for name in sorted(new):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage / name, out / name)
    for name in sorted(set(earlier.present) - set(new)):  # the earlier export's own, unchanged (checked above)
        (out / name).unlink(missing_ok=True)
    _write_manifest(out / MANIFEST_FILE, stage, new, {}, refs)
    fsync_dir(out)
    shutil.rmtree(stage)
    return out


def note_reference(out: Path, intent: dict[str, Any], done: dict[str, Any]) -> None:
    """Replace the MLflow reference ``intent`` recorded at commit with ``done`` (the ids MLflow gave it)."""
    earlier = read_manifest(out)
    assert earlier is not None and not earlier.pending, f"{out}: no committed export"
    refs = earlier.referenced_by
    i = next((i for i in range(len(refs) - 1, -1, -1) if refs[i] == intent), None)
    refs = [*refs[:i], done, *refs[i + 1 :]] if i is not None else [*refs, done]
    _write_manifest(out / MANIFEST_FILE, out, earlier.files, {}, refs)
