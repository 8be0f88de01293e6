"""The collective checkpoint writer: every rank stages its files into one temporary directory, then one commit (rank 0:
completeness, the checksums every rank computed of its own files, manifest, fsync, rename) makes the checkpoint visible,
registers it (a callable, e.g. MLflow) and prunes old ones. ``stage`` -> ``write`` -> ``commit`` are separate calls so a
caller can put work between them: an asynchronous save takes a :meth:`CheckpointWriter.snapshot` (host memory) instead
of ``write``, writes it in a background thread (``snapshot.py``) and commits at a later step boundary; ``save`` runs all
three at once.

The model state is written either by a callable (a DeepSpeed engine's own save, per rank: format ``deepspeed``) or
as full weights plus optional optimizer moments (format ``full``, rank 0 only), which needs no engine: derived runs
(``grow``, ``prune``) write their first checkpoint this way on the driver, in a :class:`LocalWorld`.
"""

from __future__ import annotations

import errno
import re
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from pretrain.checkpoint import layout, store, weights
from pretrain.checkpoint.manifest import FORMAT_DEEPSPEED, FORMAT_FULL, FileEntry, Manifest
from pretrain.checkpoint.snapshot import FileJob, HostBuffers, HostCopy, Snapshot
from pretrain.config import RunConfig, config_hash, dump_yaml

RNG_SCHEME = "torch.manual_seed(crc32(seed:step:rank)) each step"


class World(Protocol):
    """The processes writing one checkpoint together (rank 0 commits)."""

    rank: int
    world_size: int

    def barrier(self) -> None: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order (on rank 0; other ranks may get anything)."""


class LocalWorld:
    """A world of one process (the driver writing a derived run): no process group needed."""

    rank, world_size = 0, 1

    def barrier(self) -> None:
        pass

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather(self, obj: Any) -> list[Any]:
        return [obj]


@dataclass
class EngineState:
    """Format ``deepspeed``: ``save(directory, on_file)`` writes this rank's engine state into ``directory``
    (collective), calls ``on_file(path)`` as each file is written (to hash it while the next is written) and
    returns the files this rank wrote there; ``snapshot(directory, host_copy)`` (for an asynchronous save)
    holds the same files in host memory instead: it returns the files written at once and the jobs that write
    the others later."""

    save: Callable[[Path, Callable[[Path], None]], list[Path]]
    snapshot: Callable[[Path, HostCopy], tuple[list[Path], list[FileJob]]] | None = None
    moe_ep_size: int | None = None
    """The expert-parallel size the files were saved with, where it is not the config's ``parallel.expert`` (a
    derived run's copy of its parent's engine files, under a config that may set another layout for what it trains
    next); None: the config's."""


@dataclass
class FullWeights:
    """Format ``full``: the full model weights and, optionally, AdamW moments by parameter name (rank 0 writes)."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, Any] | None = None


@dataclass
class Contents:
    """What one rank puts into a checkpoint. ``cfg``, ``trainer_state`` and the tokenizer are written by rank 0."""

    cfg: RunConfig
    """The config as of this step (growth may have changed the architecture)."""
    trainer_state: dict[str, Any]
    """Loop counters (``step``, ``tokens_seen``, ``sequences``, ``last_train_loss``, ``last_val``) and callback
    state."""
    data_state: dict[str, Any]
    """This rank's data stream state (the union over ranks is the data position)."""
    model: EngineState | FullWeights
    rng_state: dict[str, torch.Tensor] = field(default_factory=lambda: {"torch": torch.get_rng_state()})
    other_ranks: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = field(default_factory=dict)
    """(data state, RNG state) of ranks that write nothing themselves, written by this one (rank 0): a derived run's
    first checkpoint, written by one process for the parent's worker count."""

    @property
    def format(self) -> str:
        return FORMAT_DEEPSPEED if isinstance(self.model, EngineState) else FORMAT_FULL


@dataclass(frozen=True)
class Staged:
    """A checkpoint being written: its staging directory (the same on every rank) and step."""

    path: Path
    step: int


def describe(contents: Contents, run_id: str, world_size: int) -> Manifest:
    """The manifest of ``contents`` (files are added at commit)."""
    cfg, state = contents.cfg, contents.trainer_state
    return Manifest(
        step=int(state["step"]),
        world_size=world_size,
        format=contents.format,
        run_id=run_id,
        tokens_seen=int(state.get("tokens_seen", 0)),
        config_hash=config_hash(cfg),
        model_kind=cfg.model.kind,
        moe_ep_size=_moe_ep_size(contents),
        data_position={"global_sequences": int(state.get("sequences", 0)), "num_streams": cfg.data.num_streams},
        rng={"scheme": RNG_SCHEME, "states": layout.RNG_PATTERN},
        metrics={"train/loss": state.get("last_train_loss", float("nan")), **state.get("last_val", {})},
    )


def _moe_ep_size(contents: Contents) -> int:
    """The expert-parallel layout of the engine state in ``contents`` (0: no MoE), as the manifest records it."""
    if not contents.cfg.moe.enabled:
        return 0
    saved = contents.model.moe_ep_size if isinstance(contents.model, EngineState) else None
    return contents.cfg.parallel.expert if saved is None else saved


class CheckpointWriter:
    """Writes committed checkpoints into ``run_dir`` (collective: every rank of ``world`` makes the same calls).
    ``register(path, manifest)`` runs on rank 0 after each commit (MLflow registration); ``keep_last`` prunes."""

    def __init__(
        self,
        run_dir: Path,
        world: World,
        run_id: str,
        *,
        keep_last: int = 0,
        register: Callable[[Path, Manifest], None] | None = None,
    ):
        self.run_dir, self.world, self.run_id = Path(run_dir), world, run_id
        self.keep_last, self.register = keep_last, register
        self._deleting: threading.Thread | None = None  # rank 0: pruned checkpoints being deleted
        self.unrecorded: list[tuple[Path, Manifest]] = []
        """Rank 0: committed checkpoints ``register`` failed for (the tracking server down), oldest first; retried
        at each commit and by :meth:`record_pending`."""

    def stage(self, step: int) -> Staged:
        """Create the staging directory of ``step`` (collective: rank 0 picks the name)."""
        nonce = self.world.broadcast(store.new_nonce() if self.world.rank == 0 else None)
        path = layout.staging_dir(self.run_dir, step, nonce)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a full disk, a read-only mount: the one line a failed commit gives
            raise self.failure(step, self.world.rank, one_line(e)) from e
        return Staged(path, step)

    def write(self, staged: Staged, contents: Contents) -> dict[str, FileEntry]:
        """This rank's files: its data position and RNG state, its part of the model state, and on rank 0 the
        config, trainer state and tokenizer. Returns their sizes and checksums, hashed here right after writing
        (every rank in parallel, each only its own files) for :meth:`commit`."""
        return self.snapshot(staged, contents, in_memory=False).write()

    def snapshot(
        self,
        staged: Staged,
        contents: Contents,
        in_memory: bool = True,
        buffers: HostBuffers | None = None,
        defer_copies: bool = False,
    ) -> Snapshot:
        """:meth:`write`'s files as a :class:`Snapshot` (collective): with ``in_memory``, the model state is
        copied to host memory (``EngineState.snapshot``; full weights copied), to be written by
        :meth:`Snapshot.write` later, e.g. in a :class:`BackgroundWrite`; otherwise it is written now. Every
        other file's content is fixed here too (copied or serialized), so the caller may go on training. The
        copies are drawn from ``buffers`` when given. With ``defer_copies`` the bytes of the tensors are copied
        later, by :meth:`Snapshot.finish_copy` (a :class:`BackgroundWrite` runs it first): until then the caller
        must leave the live state unchanged. A failure of the engine's own save is :meth:`failure`'s one line."""
        rank, stage, model = self.world.rank, staged.path, contents.model
        host_copy = HostCopy(buffers, deferred=defer_copies and in_memory)
        snap = Snapshot(stage)
        if isinstance(model, EngineState):
            try:
                if in_memory and model.snapshot is not None:
                    written, jobs = model.snapshot(weights.ds_engine_dir(stage), host_copy)
                    snap.written += written
                    snap.jobs += jobs
                else:
                    snap.written += model.save(weights.ds_engine_dir(stage), snap.digests.add)
            except Exception as e:
                # The engine's own save (collective) failed on this rank, a full disk say: raised here, at once,
                # as the one line a failed commit gives (a commit would wait for ranks left in the engine's save).
                snap.digests.close()
                raise self.failure(staged.step, rank, one_line(e)) from e
        elif rank == 0:
            full = host_copy(model.weights) if in_memory else model.weights
            snap.jobs.append(FileJob([stage / layout.WEIGHTS], partial(weights.save_full_weights, stage, full)))
            if model.moments is not None:
                moments = host_copy(model.moments) if in_memory else model.moments
                snap.jobs.append(
                    FileJob([stage / layout.OPTIMIZER], partial(weights.save_optimizer_moments, stage, moments))
                )
        ranks = {rank: (contents.data_state, contents.rng_state), **(contents.other_ranks if rank == 0 else {})}
        for r, (data_state, rng_state) in ranks.items():
            data_path, rng_path = stage / layout.data_file(r), stage / layout.rng_file(r)
            snap.jobs.append(FileJob([data_path], partial(store.write_json, data_path, host_copy(data_state))))
            snap.jobs.append(FileJob([rng_path], partial(_save_tensors, rng_path, host_copy(rng_state))))
        if rank == 0:
            cfg_text, tokenizer = dump_yaml(contents.cfg), Path(contents.cfg.data.tokenizer)
            snap.jobs.append(FileJob([stage / layout.CONFIG], partial((stage / layout.CONFIG).write_text, cfg_text)))
            snap.jobs.append(
                FileJob(
                    [stage / layout.TRAINER_STATE],
                    partial(store.write_json, stage / layout.TRAINER_STATE, host_copy(contents.trainer_state)),
                )
            )
            files = sorted(p.relative_to(tokenizer) for p in tokenizer.rglob("*") if p.is_file())
            snap.jobs.append(
                FileJob(
                    [stage / layout.TOKENIZER / f for f in files],
                    partial(shutil.copytree, tokenizer, stage / layout.TOKENIZER),
                )
            )
        snap.nbytes, snap.storages = host_copy.nbytes, host_copy.storages
        if host_copy.deferred:
            snap.deferred_copy = host_copy.copy_pending
        return snap

    def commit(
        self,
        staged: Staged,
        manifest: Manifest,
        protect: set[str] | frozenset[str] = frozenset(),
        written: dict[str, FileEntry] | None = None,
        failed: str | None = None,
    ) -> Path:
        """Make ``staged`` a committed checkpoint once every rank has written (collective). Rank 0 gathers every
        rank's ``written`` digests (from :meth:`write`) into the manifest, commits, registers and prunes (never a
        path in ``protect``); every rank returns the committed path, or raises the same
        :class:`store.CheckpointError` — also when a rank's write ``failed`` (its one-line error): then nothing
        is committed. The three collective parts, for a caller that runs rank 0's part in the background:
        :meth:`gather`, :meth:`commit_gathered` (rank 0), :meth:`outcome`."""
        parts = self.gather(written, failed)
        return self.outcome(staged, self.commit_gathered(staged, manifest, protect, parts))

    def gather(self, written: dict[str, FileEntry] | None, failed: str | None) -> list[Any]:
        """Every rank's digests and failure, on rank 0 (collective)."""
        return self.world.gather((written or {}, failed))

    def commit_gathered(
        self, staged: Staged, manifest: Manifest, protect: set[str] | frozenset[str], parts: list[Any]
    ) -> tuple[str | None, Path | None]:
        """Rank 0's part of :meth:`commit` (other ranks: nothing): ``(error, None)`` or ``(None, committed path)``."""
        if self.world.rank != 0:
            return None, None
        try:
            bad = [(r, e) for r, (_, e) in enumerate(parts) if e]
            if bad:
                return (f"rank {bad[0][0]}: {bad[0][1]}" if self.world.world_size > 1 else bad[0][1]), None
            final = store.commit(staged.path, self.run_dir, manifest, store.merge_digests([d for d, _ in parts]))
        except Exception as e:  # tell the other ranks instead of leaving them in a barrier
            return f"{type(e).__name__}: {e}", None
        # Committed: what follows is housekeeping, and a failure of it is no failed save (nor a reason to end a run
        # whose checkpoint is on disk): said, and tried again at the next commit.
        try:
            self._prune(protect)
        except Exception as e:
            print(
                f"[checkpoint] warning: {final.name} committed, but pruning older checkpoints failed "
                f"({one_line(e)}); tried again at the next checkpoint",
                file=sys.stderr,
            )
        self.unrecorded.append((final, manifest))
        self.record_pending()
        return None, final

    def record_pending(self) -> list[Path]:
        """Rank 0: ``register`` the committed checkpoints not recorded yet, oldest first, until one fails (said on
        stderr); returns those still unrecorded."""
        while self.unrecorded and self.register is not None:
            path, manifest = self.unrecorded[0]
            if not path.is_dir():  # pruned meanwhile (keep_last): nothing to record
                self.unrecorded.pop(0)
                continue
            try:
                self.register(path, manifest)
            except Exception as e:
                names = ", ".join(p.name for p, _ in self.unrecorded)
                print(
                    f"[checkpoint] warning: recording {names} in MLflow failed ({one_line(e)}); "
                    "committed on disk (a resume by path finds it), recorded at the next checkpoint",
                    file=sys.stderr,
                )
                break
            self.unrecorded.pop(0)
        if self.register is None:
            self.unrecorded.clear()
        return [p for p, _ in self.unrecorded]

    def _prune(self, protect: set[str] | frozenset[str]) -> None:
        """:func:`store.prune` now (out of sight at once); the deletion of the pruned directories in a thread
        (a large checkpoint takes a while to delete: the loop need not wait for it)."""
        self.settle()
        trash = store.prune(self.run_dir, self.keep_last, protect, delete=False)
        if trash:
            self._deleting = threading.Thread(
                target=store.delete_trees, args=(trash,), name="checkpoint-prune", daemon=True
            )
            self._deleting.start()

    def settle(self) -> None:
        """Wait until pruned checkpoints are deleted (a run's end; a killed run leaves them under leftover names,
        removed at the next start)."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    def outcome(self, staged: Staged, result: tuple[str | None, Path | None]) -> Path:
        """Rank 0's :meth:`commit_gathered` result on every rank (collective): the path, or the one-line error."""
        error, final = self.world.broadcast(result)
        if error:
            raise save_error(f"checkpoint at step {staged.step} failed: {error}")
        return final

    def failure(self, step: int, rank: int, error: str) -> store.CheckpointError:
        """The error of a save that ``rank`` could not write (``error``: one line), worded as :meth:`outcome`'s."""
        return save_error(
            f"checkpoint at step {step} failed: {f'rank {rank}: {error}' if self.world.world_size > 1 else error}"
        )

    def save(self, contents: Contents, protect: set[str] | frozenset[str] = frozenset()) -> Path:
        """Stage, write and commit ``contents`` (collective). A rank's failure to write (a full disk) is one
        :class:`store.CheckpointError`, worded as an asynchronous save's: reported by :meth:`commit` on every rank,
        or raised by the rank at once when the engine's own save failed (:meth:`snapshot`). Nothing is committed;
        the checkpoints committed before stay as they are."""
        staged = self.stage(int(contents.trainer_state["step"]))
        snap = self.snapshot(staged, contents, in_memory=False)
        written, failed = write_reporting(snap)
        return self.commit(staged, describe(contents, self.run_id, self.world.world_size), protect, written, failed)


def write_reporting(snap: Snapshot) -> tuple[dict[str, FileEntry], str | None]:
    """:meth:`Snapshot.write`, its failure as a one-line error (for :meth:`CheckpointWriter.commit`)."""
    try:
        return snap.write(), None
    except Exception as e:
        return {}, one_line(e)


_UNWRITABLE = re.compile(
    rf"\[Errno ({'|'.join(str(n) for n in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES))})\]"
)
"""A failed write's :func:`one_line` whose cause is the place, not the moment: no space, no quota, a read-only
filesystem, no permission."""


def save_error(message: str) -> store.CheckpointError:
    """A failed save's one line as its error: :class:`store.CheckpointNotWritable` where a rank's failure says the
    place cannot take it (:data:`_UNWRITABLE`), which no restart passes; else a plain one (an I/O error a restart
    may pass)."""
    return (store.CheckpointNotWritable if _UNWRITABLE.search(message) else store.CheckpointError)(message)


def one_line(e: BaseException) -> str:
    """A rank's failure to write, as every rank reports it: ``OSError: [Errno 28] No space left on device: ...``."""
    return f"{type(e).__name__}: {e}"


def _save_tensors(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)
