"""The training side of checkpointing: the :class:`Checkpointer` that ``CheckpointCallback`` calls. It checks the
weights, then hands the run's state to the checkpoint layer's collective writer (``pretrain/checkpoint/writer.py``)
with the engine's own save as the model state; registration in MLflow is the writer's hook.

Synchronous (``checkpoint.async: false``): :meth:`Checkpointer.save` writes, hashes and commits; the loop waits.
Asynchronous (the default): ``save`` copies this rank's state to host memory (the only stall) and starts a
:class:`~pretrain.checkpoint.snapshot.BackgroundWrite`; at every later step boundary :meth:`Checkpointer.poll`
all-reduces one small "done / failed" pair, so every rank sees the same answer at the same step, and once all
ranks are done the commit runs as a synchronous save's does (rank 0: manifest, fsync, rename, MLflow, pruning), or
every rank raises the same one-line :class:`CheckpointError`. :meth:`Checkpointer.finish` waits for the save in
flight (before the next save: at most one host snapshot exists; before a rollback; at the end of the run).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pretrain import ds_adapter
from pretrain.checkpoint import layout
from pretrain.checkpoint.manifest import Manifest
from pretrain.checkpoint.snapshot import BackgroundWrite, HostBuffers
from pretrain.checkpoint.store import CheckpointError
from pretrain.checkpoint.writer import CheckpointWriter, Contents, Staged, describe
from pretrain.config import RunConfig
from pretrain.train import dist
from pretrain.train.health import nonfinite_params

GB = 1e9


class NonFiniteWeightsError(CheckpointError):
    """The weights hold NaN/Inf: the checkpoint was not written."""


class DistWorld:
    """The training job's process group as the writer's :class:`~pretrain.checkpoint.writer.World`."""

    def __init__(self, ctx: dist.DistContext):
        self.rank, self.world_size = ctx.rank, ctx.world_size

    def barrier(self) -> None:
        dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        return dist.broadcast_object(obj)

    def gather(self, obj: Any) -> list[Any]:
        return dist.gather_object(obj)


@dataclass
class SaveRecord:
    """The cost of one save, as logged (``ckpt/*`` metrics at its step) and listed in the summary."""

    step: int
    stall_s: float = 0.0
    """Loop time this save took: the snapshot (or the whole synchronous save), waits for it, the commit."""
    snapshot_s: float = 0.0
    """The snapshot (asynchronous: the copy to host memory, or with ``checkpoint.overlap_copy`` only its
    structure and memory, the bytes being copied in the background) or the whole write + commit (synchronous)."""
    commit_s: float = 0.0
    """Asynchronous: the loop's part of the commit at later step boundaries (the all-reduces, the gather of the
    digests, sharing the outcome; rank 0's manifest, rename, MLflow registration and pruning run in the
    background unless the run waits for them)."""
    copy_wait_s: float = 0.0
    """Asynchronous with ``checkpoint.overlap_copy``: the next update waiting for the copy to host memory, which
    runs in the background during the next forward and backward."""
    wait_s: float = 0.0
    """Asynchronous: waiting for this save's background write or commit, when the next save, a rollback or the
    end of the run came before they finished (the save interval is shorter than the write)."""
    snapshot_gb: float = 0.0
    """Host memory of the snapshot: the largest over ranks (0 when synchronous)."""
    write_s: float = 0.0
    """Asynchronous: the background write, hash and fsync, the slowest rank."""
    copy_s: float = 0.0
    """Asynchronous with ``checkpoint.overlap_copy``: the copy to host memory in the background, the slowest rank
    (the loop waits only for ``copy_wait_s`` of it)."""

    def metrics(self) -> dict[str, float]:
        return {f"ckpt/{k}": float(v) for k, v in asdict(self).items() if k != "step"}


@dataclass
class InFlight:
    """An asynchronous save between its snapshot and its commit."""

    staged: Staged
    manifest: Manifest
    write: BackgroundWrite
    record: SaveRecord
    protect: Callable[[], set[str]] = field(default=set)
    committing: threading.Thread | None = None
    """Rank 0's commit (other ranks: an empty thread), started once every rank has written."""
    result: tuple[str | None, Path | None] = (None, None)
    """Rank 0's commit outcome: (one-line error, committed path)."""


def _nothing() -> None:
    pass


class Checkpointer:
    """Writes committed checkpoints of this run (collective: every rank makes the same calls at the same steps)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, ctx: dist.DistContext, tracker):
        self.ctx, self.run_dir, self.tracker = ctx, Path(run_dir), tracker
        self.asynchronous = cfg.checkpoint.async_
        self.buffers = HostBuffers() if self.asynchronous and cfg.checkpoint.keep_host_buffers else None
        self.overlap_copy = self.asynchronous and cfg.checkpoint.overlap_copy
        self._warmed = False
        self.faults = cfg.faults
        self.writer = CheckpointWriter(
            run_dir,
            DistWorld(ctx),
            tracker.run_id,
            keep_last=cfg.checkpoint.keep_last,
            register=tracker.register_checkpoint,
        )
        self.seconds = 0.0  # loop time spent in checkpointing (``stall_s`` summed): `bench --cluster` reads it
        self.count = 0
        self.records: list[SaveRecord] = []
        self.in_flight: InFlight | None = None

    def warm(self, module) -> None:
        """Once, after the first optimizer step (when the optimizer state exists): prepare the host memory of the
        first asynchronous snapshot in the background (:meth:`HostBuffers.warm`)."""
        if self.buffers is not None and not self._warmed:
            self._warmed = True
            self.buffers.warm(module.live_state())

    def save(self, module, batches, state, protect: Callable[[], set[str]] = set) -> Path:
        """Save the state of this step: committed on return (synchronous) or in flight (asynchronous: committed
        by a later :meth:`poll` or :meth:`finish`). Returns the path the checkpoint is committed at.
        ``protect()``: checkpoint paths pruning must keep (asked at the commit)."""
        self.finish()  # at most one save in flight: the next one waits for it
        t0 = time.perf_counter()
        record = SaveRecord(step=state.step)
        started = False  # a save refused (non-finite weights) or failed before it was written is not counted
        try:
            # Every rank checks its shard before anything is staged: a NaN/Inf checkpoint is never written.
            if dist.all_reduce_sum([nonfinite_params(module.engine)], self.ctx.device)[0] > 0:
                raise NonFiniteWeightsError(f"step {state.step}: non-finite weights, checkpoint not written")
            # The module's config: the architecture as of this step (growth).
            contents = Contents(
                cfg=module.cfg,
                trainer_state=asdict(state),
                data_state=batches.state_dict(),
                model=module.checkpoint_state(),
            )
            if not self.asynchronous:
                path = self.writer.save(contents, protect())
                started = True
                self.tracker.log_metrics({"ckpt/stall_s": time.perf_counter() - t0}, state.step)
                return path
            # Asynchronous: the loop waits only for this (collective: the same staging directory everywhere).
            # The copy may overlap the next forward and backward only while the state handed over stays valid
            # (not under an optimizer whose checkpoint epilogue swaps it out again: ZeRO-3 with NVMe offload).
            overlap = self.overlap_copy and ds_adapter.checkpoint_state_stays_live(module.engine)
            staged = self.writer.stage(state.step)
            snap = self.writer.snapshot(staged, contents, buffers=self.buffers, defer_copies=overlap)
            manifest = describe(contents, self.writer.run_id, self.ctx.world_size)
            write = BackgroundWrite(snap, state.step, self._fault_delay(state.step))
            if overlap:  # the next update (or any change of the state) waits for the copy
                module.hold(functools.partial(self._wait_copied, write, record))
            self.in_flight = InFlight(staged, manifest, write, record, protect)
            started = True
            return self.run_dir / layout.step_dir_name(state.step)
        finally:  # the loop stalls for this part: measured for `bench --cluster` and `bench --checkpoint`
            self._account(record, time.perf_counter() - t0, "snapshot_s")
            if started:
                self.records.append(record)
                self.count += 1

    def poll(self) -> Path | None:
        """At a step boundary (every rank): advance the save in flight; the committed path once it is committed,
        else None (nothing in flight, still writing, or still committing); raises its failure. One small
        all-reduce per step while a save is in flight, so every decision is the same on every rank: once every
        rank has written, the digests are gathered and rank 0 commits in the background (manifest, fsync,
        rename, MLflow, pruning); a later boundary sees the commit done and shares its outcome."""
        flight = self.in_flight
        if flight is None:
            return None
        t0 = time.perf_counter()
        if flight.committing is None:
            w = flight.write
            finished = w.done()
            done, failed = dist.all_reduce_sum(
                [float(finished), float(finished and w.error is not None)], self.ctx.device
            )
            if done == self.ctx.world_size or failed:
                self._start_commit(flight, background=True)
            self._account(flight.record, time.perf_counter() - t0, "commit_s")
            return None
        finished = not flight.committing.is_alive()
        done = dist.all_reduce_sum([float(finished)], self.ctx.device)[0]
        self._account(flight.record, time.perf_counter() - t0, "commit_s")
        return self.finish() if done == self.ctx.world_size else None

    def finish(self) -> Path | None:
        """Wait until the save in flight is written on every rank and committed (collective); its path, or None
        when none was in flight. Raises the save's one-line :class:`CheckpointError` when a rank failed."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return None
        if flight.committing is None:
            self._start_commit(flight, background=False)
        t0 = time.perf_counter()
        assert flight.committing is not None  # started above if it was not
        flight.committing.join()
        self._account(flight.record, time.perf_counter() - t0, "wait_s")
        t0 = time.perf_counter()
        try:
            path = self.writer.outcome(flight.staged, flight.result)
        finally:
            self._account(flight.record, time.perf_counter() - t0, "commit_s")
        self.tracker.log_metrics(flight.record.metrics(), flight.record.step)
        return path

    def _start_commit(self, flight: InFlight, background: bool) -> None:
        """Every rank has written (or one failed): wait for this rank's write, gather the digests and start rank
        0's commit, in a thread when ``background`` (other ranks: a thread with nothing to do)."""
        record, write = flight.record, flight.write
        t0 = time.perf_counter()
        write.wait()
        self._account(record, time.perf_counter() - t0, "wait_s")
        t0 = time.perf_counter()
        if self.buffers is not None:  # written: the next snapshot copies into the same memory
            self.buffers.release(write.storages)
        write.storages = []
        gb, seconds, copy_s = dist.all_reduce_min(
            [-write.nbytes / GB, -write.seconds, -write.copy_s], self.ctx.device
        )  # max over ranks
        record.snapshot_gb, record.write_s, record.copy_s = -gb, -seconds, -copy_s
        parts = self.writer.gather(write.digests, write.error)
        # What retention keeps is read here, on the loop's thread (the callbacks' state changes there, and a set read
        # mid-change could miss a rollback target); a set a little stale is safe: while this save is in flight no
        # checkpoint is noted, so the rollback targets can only become fewer.
        protected = flight.protect()

        def commit() -> None:
            flight.result = self.writer.commit_gathered(flight.staged, flight.manifest, protected, parts)

        if not background:
            commit()
        flight.committing = threading.Thread(
            target=commit if background else _nothing, daemon=True, name=f"checkpoint-commit-{record.step}"
        )
        flight.committing.start()  # not background: nothing left to do, ``join`` returns at once
        self._account(record, time.perf_counter() - t0, "commit_s")

    def _wait_copied(self, write: BackgroundWrite, record: SaveRecord) -> None:
        t0 = time.perf_counter()
        write.wait_copied()
        self._account(record, time.perf_counter() - t0, "copy_wait_s")

    def _account(self, record: SaveRecord, seconds: float, part: str | None = None) -> None:
        record.stall_s += seconds
        self.seconds += seconds
        if part is not None:
            setattr(record, part, getattr(record, part) + seconds)

    def _fault_delay(self, step: int) -> float:
        """``faults.slow_checkpoint_at_step``: the delay of this step's background write, once per run (a marker
        per rank in the run directory survives restarts)."""
        if self.faults.slow_checkpoint_at_step != step:
            return 0.0
        marker = self.run_dir / ".faults" / f"slow_checkpoint_at_step_{step}_rank_{self.ctx.rank}"
        if marker.exists():
            return 0.0
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{self.faults.slow_checkpoint_s} s\n")
        print(
            f"[fault] rank {self.ctx.rank}: the background write of step {step}'s checkpoint sleeps "
            f"{self.faults.slow_checkpoint_s:g} s first",
            flush=True,
        )
        return self.faults.slow_checkpoint_s

    def summary(self) -> dict[str, Any]:
        """The summary's checkpoint fields (``summary.json``): totals and one record per save."""
        return {
            "checkpoint_seconds": self.seconds,
            "checkpoints": self.count,
            "checkpoint_async": self.asynchronous,
            "checkpoint_stall_s_max": max((r.stall_s for r in self.records), default=0.0),
            "checkpoint_snapshot_gb_max": max((r.snapshot_gb for r in self.records), default=0.0),
            "checkpoint_saves": [asdict(r) for r in self.records],
        }
