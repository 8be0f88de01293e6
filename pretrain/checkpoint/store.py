"""Committed checkpoints on disk: the commit protocol (checksums, manifest, fsync, rename), discovery, verification,
pruning and cleanup. Only a directory named ``step_NNNNNNNN`` holding a manifest that parses is committed; resume,
listing and MLflow registration only ever see committed ones. Collective writing is in ``writer.py``."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.checkpoint import layout
from pretrain.checkpoint.hash_tally import sha256_file
from pretrain.checkpoint.manifest import FORMAT_DEEPSPEED, FileEntry, Manifest
from pretrain.config.errors import not_a
from pretrain.invocation import command


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or could not be written or read."""


class BadCheckpoint(CheckpointError):
    """A checkpoint that is not what it must be, or not what this run can load, the same on every read: not there,
    not committed, its files not what its manifest records (missing, another size or checksum; the manifest
    corrupt), or of a layout the resume cannot load. An I/O error while reading or writing one is a plain
    :class:`CheckpointError` (a retry may pass)."""


class CheckpointNotWritable(CheckpointError):
    """A save the place it goes cannot take: the disk or the quota is full, the filesystem read-only, the directory
    not the run's to write. A restart trains again from the last checkpoint and fails the same way at its next
    save, until the user frees space or fixes the permissions."""


def new_nonce() -> str:
    return uuid.uuid4().hex[:12]


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or removal in ``path`` durable. A filesystem that cannot fsync a directory (EINVAL, ENOTSUP:
    some network and FUSE filesystems; Windows cannot open one) is passed over; a real I/O error (EIO, ENOSPC) is
    raised: a commit is not durable then."""
    try:
        fsync_file(path)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EISDIR):
            raise


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


class Digests:
    """Size, sha256 and fsync of files as their writer finishes them: each file given to :meth:`add` is fsynced on a
    background thread (disk) and, unless it was hashed while written (``hashed_write.HashingFile``: the large
    engine files), hashed on another (CPU), so the hashing overlaps both the fsync and the files still being written,
    and a rank's save costs about its write, not its write plus a re-read. Only the rank that
    wrote a file adds it. :meth:`result` waits for every file and returns their entries (or raises the first
    failure)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-fsync")
        self._pending: dict[Path, tuple[Future, Future]] = {}
        self._lock = threading.Lock()  # files may be added from several writing threads

    def add(self, paths: Path | list[Path], hashed: dict[Path, str] | None = None) -> None:
        """Hash (unless ``hashed`` holds the file's digest, taken while it was written) and fsync ``paths``."""
        for path in [paths] if isinstance(paths, Path) else paths:
            with self._lock:
                if path in self._pending:
                    continue
                digest = hashed.get(path) if hashed else None
                if digest is None:
                    digest_f = self._hasher.submit(sha256_file, path)
                else:
                    digest_f = Future()
                    digest_f.set_result(digest)
                self._pending[path] = (self._syncer.submit(fsync_file, path), digest_f)

    def result(self) -> dict[str, FileEntry]:
        try:
            entries: dict[str, FileEntry] = {}
            for path in sorted(self._pending):
                synced, digest = self._pending[path]
                synced.result()
                entries[path.relative_to(self.root).as_posix()] = FileEntry(path.stat().st_size, digest.result())
            return entries
        finally:
            self.close()

    def close(self) -> None:
        """Stop the threads (waiting for the files already added)."""
        self._hasher.shutdown()
        self._syncer.shutdown()
        self._pending = {}


def hash_files(root: Path, paths: list[Path] | None = None) -> dict[str, FileEntry]:
    """Size and sha256 of ``paths`` (default: every file under ``root``), keyed by POSIX path relative to
    ``root``; each file is fsynced too (:class:`Digests`). A writer may call it per rank on the files that rank
    wrote and merge."""
    digests = Digests(root)
    digests.add(sorted(paths if paths is not None else (p for p in root.rglob("*") if p.is_file())))
    return digests.result()


def merge_digests(parts: list[dict[str, FileEntry]]) -> dict[str, FileEntry]:
    """One entry per file from every rank's :func:`hash_files` (a file claimed by two ranks is a writer bug)."""
    merged: dict[str, FileEntry] = {}
    for part in parts:
        twice = merged.keys() & part.keys()
        if twice:
            raise CheckpointError(f"files hashed by two ranks: {', '.join(sorted(twice))}")
        merged.update(part)
    return dict(sorted(merged.items()))


def missing_parts(stage: Path, manifest: Manifest) -> list[str]:
    """What a complete checkpoint of ``manifest.world_size`` ranks and ``manifest.format`` lacks in ``stage``."""
    missing = [layout.data_file(r) for r in range(manifest.world_size) if not (stage / layout.data_file(r)).is_file()]
    if manifest.format == FORMAT_DEEPSPEED:
        if not (stage / layout.DS_DIR / layout.DS_TAG).is_dir():
            missing.append(f"{layout.DS_DIR}/{layout.DS_TAG}/")
    elif not (stage / layout.WEIGHTS).is_file():
        missing.append(layout.WEIGHTS)
    return missing


def commit(stage: Path, run_dir: Path, manifest: Manifest, files: dict[str, FileEntry] | None = None) -> Path:
    """Commit a fully written ``stage`` as the checkpoint of ``manifest.step`` (one process, after every writer
    finished): check completeness, checksum (unless ``files`` already holds every file's entry: the writers' own
    digests, so the committing process reads no file), fsync, write the manifest last and rename the directory
    into place. Returns the committed path."""
    missing = missing_parts(stage, manifest)
    if missing:
        raise CheckpointError(f"{stage}: incomplete checkpoint, missing {', '.join(missing)}")
    if files is not None:  # names only (no file is read): every file written must have been hashed by its writer
        unhashed = sorted(
            p.relative_to(stage).as_posix()
            for p in stage.rglob("*")
            if p.is_file()
            if p.relative_to(stage).as_posix() not in files
        )
        if unhashed:
            raise CheckpointError(f"{stage}: files no rank hashed: {', '.join(unhashed)}")
    manifest.files = files if files is not None else hash_files(stage)
    for d in sorted({p.parent for p in stage.rglob("*")} | {stage}):
        fsync_dir(d)
    manifest.committed_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(stage / layout.MANIFEST, manifest.to_dict())
    fsync_file(stage / layout.MANIFEST)
    fsync_dir(stage)  # the manifest's name too, before the stage is renamed into place
    final = run_dir / layout.step_dir_name(manifest.step)
    if final.exists():  # a re-run of the same step (e.g. after a restart): the old one waits aside until replaced
        previous = layout.superseded_dir(run_dir, manifest.step, new_nonce())
        os.replace(final, previous)
        os.replace(stage, final)  # interrupted before this: the next start puts the old one back
        fsync_dir(run_dir)
        shutil.rmtree(previous, ignore_errors=True)
    else:
        os.replace(stage, final)
    fsync_dir(run_dir)
    return final


@dataclass(frozen=True)
class CommittedCheckpoint:
    path: Path
    step: int
    manifest: Manifest


def read_manifest(path: Path) -> Manifest:
    try:
        raw = json.loads((path / layout.MANIFEST).read_text())
    except FileNotFoundError:
        raise BadCheckpoint(f"{path}: not a committed checkpoint (no {layout.MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadCheckpoint(f"{path}/{layout.MANIFEST}: corrupt manifest ({e})") from None
    except OSError as e:  # unreadable (permissions), or the step's name on something that is no directory
        raise CheckpointError(f"{path}/{layout.MANIFEST}: cannot read it ({e.strerror or type(e).__name__})") from None
    try:
        return Manifest.from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise BadCheckpoint(f"{path}/{layout.MANIFEST}: corrupt manifest ({type(e).__name__}: {e})") from None


def open_committed(path: Path) -> CommittedCheckpoint:
    """The committed checkpoint at ``path`` (manifest read, not verified)."""
    manifest = read_manifest(path)
    return CommittedCheckpoint(path, manifest.step, manifest)


def check_present(path: Path, manifest: Manifest, only: set[str] | None = None) -> None:
    """Every file listed in the manifest (or its subset ``only``) exists with the recorded size (no file is read;
    a manifest entry without a size is checked for presence)."""
    for rel, meta in manifest.files.items():
        if only is not None and rel not in only:
            continue
        f = path / rel
        if not f.is_file():
            raise BadCheckpoint(f"{path}: missing file {rel}")
        if meta.bytes is not None and f.stat().st_size != meta.bytes:
            raise BadCheckpoint(f"{path}: checksum mismatch for {rel}")  # worded as a checksum: a size is one


def verify(path: Path, manifest: Manifest | None = None, only: set[str] | None = None) -> None:
    """Check every file listed in the manifest (or its subset ``only``) exists with the recorded size and
    checksum; the error names the first bad file."""
    manifest = manifest or read_manifest(path)
    check_present(path, manifest, only)
    for rel, meta in manifest.files.items():
        if only is not None and rel not in only:
            continue
        try:  # a read error (EIO, a stale NFS handle) is this checkpoint's one-line error, on the rank that met it
            digest = sha256_file(path / rel)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {rel} ({e.strerror or e})") from None
        if digest != meta.sha256:
            raise BadCheckpoint(f"{path}: checksum mismatch for {rel}")


PARSED_EARLY = frozenset({layout.CONFIG, layout.TRAINER_STATE})
"""The files of a checkpoint the driver parses before any worker starts (small): the early check hashes them."""


def check_early(path: Path, manifest: Manifest) -> None:
    """The driver's early check: every file present with its recorded size (:func:`check_present`), and the files it
    parses (:data:`PARSED_EARLY`) with their checksums; the workers verify the checksums of the rest, in parallel."""
    check_present(path, manifest)
    verify(path, manifest, set(PARSED_EARLY))


def verify_or_point_back(
    ckpt: CommittedCheckpoint, full: bool = True, resume: bool = True, hash_parsed: bool = True
) -> None:
    """:func:`verify` ``ckpt`` (``full=False``: :func:`check_early` only, hashing the small files the driver parses:
    the ranks verify checksums of what they load; ``hash_parsed=False`` too: :func:`check_present` alone, for the
    ranks, whose parallel verification hashes every byte once); when it fails, the error also names the newest
    older checkpoint of the same run directory that verifies (at the same level), and (``resume``) how to resume
    from it (a new run starting from that checkpoint)."""
    check = verify if full else check_early if hash_parsed else check_present
    try:
        check(ckpt.path, ckpt.manifest)
    except CheckpointError as e:
        raise type(e)(point_back_before(ckpt.path.parent, ckpt.step, str(e), full, resume)) from None


def point_back(ckpt: CommittedCheckpoint, error: str, full: bool = True) -> str:
    """``error`` (about ``ckpt``) followed by the newest older checkpoint of the same run directory that verifies
    (``full``: every checksum; else :func:`check_early`) and how to resume from it."""
    return point_back_before(ckpt.path.parent, ckpt.step, error, full)


def point_back_before(run_dir: Path, step: int, error: str, full: bool = True, resume: bool = True) -> str:
    """``error`` (about the checkpoint of ``step`` in ``run_dir``, whose manifest may be unreadable) followed by the
    newest older checkpoint there that verifies and (``resume``) how to resume from it."""
    check = verify if full else check_early
    for candidate in reversed([c for c in list_committed(run_dir) if c.step < step]):
        try:
            check(candidate.path, candidate.manifest)
        except CheckpointError:
            continue
        if not resume:  # export, eval, generate...: the same command takes that directory
            return f"{error}; the newest checkpoint that verifies is step {candidate.step}: {candidate.path}"
        return (
            f"{error}; the newest checkpoint that verifies is step {candidate.step}: resume from it "
            f"with {command()} resume {candidate.path}"
        )
    return f"{error}; no older checkpoint of this run verifies"


_RANK_FILE = re.compile(r"(?:^|/)rank_(\d+)\.")  # ours: data/rank_R.json, rng/rank_R.pt


def verifying_rank(rel: str, world_size: int) -> int:
    """The rank that verifies file ``rel`` at resume: a per-rank file (its data position, RNG state, ZeRO
    optimizer partition) the rank of its number (modulo ``world_size``: another worker count), every shared file
    rank 0. Each file has one verifier, so a resume hashes each byte once."""
    m = _RANK_FILE.search(rel)
    from pretrain import ds_adapter  # here, not at the top: the driver's checks of a run import no torch

    rank = int(m.group(1)) if m else ds_adapter.rank_of_state_file(rel)
    return rank % world_size if rank is not None else 0


def verify_share(path: Path, manifest: Manifest, rank: int, world_size: int) -> None:
    """:func:`verify` the files of ``path`` that ``rank`` of ``world_size`` verifies (:func:`verifying_rank`)."""
    verify(path, manifest, {rel for rel in manifest.files if verifying_rank(rel, world_size) == rank})


def is_checkpoint_dir(path: Path) -> bool:
    """``path`` holds a manifest (a committed checkpoint, as opposed to a run directory)."""
    return (path / layout.MANIFEST).is_file()


def list_committed(run_dir: Path) -> list[CommittedCheckpoint]:
    """Committed checkpoints of a run directory, oldest first (staging dirs and bad manifests are ignored)."""
    out: list[CommittedCheckpoint] = []
    if not run_dir.is_dir():
        return out
    for child in run_dir.iterdir():
        step = layout.step_of(child.name)
        if step is not None and is_checkpoint_dir(child):
            try:
                out.append(CommittedCheckpoint(child, step, read_manifest(child)))
            except CheckpointError:
                continue
    return sorted(out, key=lambda c: c.step)


def check_directory(path: Path) -> None:
    """:class:`CheckpointError` when ``path`` exists but is no directory (a checkpoint or run directory given as a
    FIFO, a file, a device): it says what it is, where a lookup would say it holds no checkpoint."""
    if not_a(path, "a directory"):
        raise BadCheckpoint(f"{path} {not_a(path, 'a directory')}")


def latest_committed(run_dir: Path, full: bool = True, resume: bool = True) -> CommittedCheckpoint | None:
    """The newest committed checkpoint of ``run_dir`` (None when it has none or does not exist); raises
    :func:`check_directory`'s error for a path that is no directory, and a CheckpointError when a newer step
    directory's manifest is missing or cannot be read (a commit renames a directory with a complete manifest into
    the step's name, so that is damage, never a save in progress): its error, the newest older checkpoint that
    verifies (``full``: every checksum; else :func:`check_early`) and (``resume``) how to resume from it."""
    check_directory(run_dir)
    found = list_committed(run_dir)
    newest = found[-1] if found else None
    if run_dir.is_dir():
        newer = [
            (step, child)
            for child in run_dir.iterdir()
            if (step := layout.step_of(child.name)) is not None and step > (newest.step if newest else -1)
        ]
        for step, child in sorted(newer, reverse=True)[:1]:
            try:
                read_manifest(child)
            except CheckpointError as e:
                raise type(e)(point_back_before(run_dir, step, str(e), full, resume)) from None
    return newest


def resolve(path: Path, full: bool = True, resume: bool = True) -> CommittedCheckpoint:
    """A checkpoint dir, or a run dir (-> its latest committed checkpoint), verified (``full=False``:
    :func:`check_early`, see :func:`verify_or_point_back`); a damaged one is refused naming the newest older
    checkpoint that verifies and (``resume``) how to resume from it."""
    path = path.resolve()
    check_directory(path)
    ckpt: CommittedCheckpoint | None
    if is_checkpoint_dir(path):
        ckpt = open_committed(path)
    else:
        ckpt = latest_committed(path, full, resume)
        if ckpt is None:
            raise BadCheckpoint(f"{path}: no committed checkpoint found")
    verify_or_point_back(ckpt, full, resume)
    return ckpt


def restore_superseded(run_dir: Path) -> list[Path]:
    """Put back each checkpoint that a re-commit of its step set aside (:func:`commit`) when the step has no
    directory: the commit was interrupted between its two renames. Returns the checkpoints put back."""
    restored: list[Path] = []
    for child in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        step = layout.superseded_step_of(child.name)
        final = run_dir / layout.step_dir_name(step) if step is not None else None
        if final is not None and not final.exists() and is_checkpoint_dir(child):
            os.replace(child, final)
            restored.append(final)
    if restored:
        fsync_dir(run_dir)
    return restored


def cleanup_staging(run_dir: Path) -> None:
    """Remove leftovers of interrupted saves (rank 0, at start), after :func:`restore_superseded`."""
    restore_superseded(run_dir)
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            if child.name.startswith(layout.LEFTOVER_PREFIXES):
                shutil.rmtree(child, ignore_errors=True)


def prune(
    run_dir: Path, keep_last: int, protect: set[str] | frozenset[str] = frozenset(), delete: bool = True
) -> list[Path]:
    """Remove committed checkpoints beyond the newest ``keep_last`` (0 keeps all), never one in ``protect``: each
    is renamed out of sight at once (a leftover name, which :func:`cleanup_staging` also removes) and then
    deleted, or, with ``delete=False``, left for the caller to delete (:func:`delete_trees`, e.g. in a thread:
    deleting a large checkpoint takes a while). Returns the renamed directories."""
    if keep_last <= 0:
        return []
    trash = []
    for ckpt in list_committed(run_dir)[:-keep_last]:
        if str(ckpt.path) not in protect:
            gone = layout.replaced_dir(run_dir, ckpt.step, new_nonce())
            try:
                os.replace(ckpt.path, gone)
            except OSError:
                continue
            trash.append(gone)
    if trash:
        fsync_dir(run_dir)
    if delete:
        delete_trees(trash)
    return trash


def delete_trees(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def abandon_after(run_dir: Path, step: int) -> list[str]:
    """Move committed checkpoints newer than ``step`` to ``run_dir/abandoned/`` (out of resume's sight)."""
    moved = []
    for c in list_committed(run_dir):
        if c.step > step:
            dest = run_dir / layout.ABANDONED / f"{c.path.name}-{new_nonce()[:6]}"
            dest.parent.mkdir(exist_ok=True)
            os.replace(c.path, dest)
            moved.append(str(dest))
    if moved:  # durable before the run goes on: after a power loss resume must not find a rejected step
        fsync_dir(run_dir / layout.ABANDONED)
        fsync_dir(run_dir)
    return moved
