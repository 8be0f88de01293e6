"""Asynchronous saving: a rank's checkpoint files held in host memory (a :class:`Snapshot`), then written, hashed
and fsynced by a :class:`BackgroundWrite` thread while training continues. The writer (``writer.py``) builds the
snapshot at the save step; the commit stays collective and happens later (see ``pretrain/train/checkpointer.py``).

The copy is what makes a background write safe: the optimizer updates its tensors in place at the next step, so
every tensor reachable from a state dict is copied into fresh host memory at the save step (on the CPU, where
``.cpu()`` returns the same tensor, a real copy), sharing storages as the originals do, so ``torch.save`` writes the
same file it would have written synchronously.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint import store
from pretrain.checkpoint.hashed_write import HashingFile
from pretrain.checkpoint.manifest import FileEntry


class HostBuffers:
    """Host memory reused from one snapshot to the next: :meth:`release` hands back a written snapshot's storages
    and :meth:`take` serves the next snapshot's copies from them by size, so a save copies into memory already
    mapped (a fresh allocation faults in every page; on a GPU, pinned memory is slow to allocate). Holds at most
    one snapshot's storages (``release`` drops what the last one did not reuse)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._warming: threading.Thread | None = None

    def warm(self, state: Any) -> None:
        """Allocate and touch, in a background thread, host memory for a snapshot of ``state`` (nested tensors,
        e.g. the engine's live state dicts: one buffer per distinct storage), so that even the first snapshot
        copies into mapped memory. The first :meth:`take` waits for it."""
        sizes: dict[int, tuple[int, bool]] = {}

        def visit(obj: Any) -> None:
            if isinstance(obj, torch.Tensor):
                st = obj.untyped_storage()
                if st.nbytes():
                    sizes[st.data_ptr()] = (st.nbytes(), st.device.type == "cuda")
            elif isinstance(obj, dict):
                for v in obj.values():
                    visit(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    visit(v)

        visit(state)

        def allocate() -> None:
            for nbytes, pinned in sizes.values():
                st = torch.UntypedStorage(nbytes, device="cpu")
                _bytes_of(st).zero_()  # fault every page in now, off the loop (and without the GIL)
                self._free.setdefault((nbytes, pinned), []).append(st.pin_memory() if pinned else st)

        self._warming = threading.Thread(target=allocate, name="checkpoint-host-buffers", daemon=True)
        self._warming.start()

    def _settle(self) -> None:
        """Wait for :meth:`warm`'s allocation, if any (it fills ``_free``)."""
        if self._warming is not None:
            self._warming.join()
            self._warming = None

    def take(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        self._settle()
        free = self._free.get((nbytes, pinned))
        if free:
            return free.pop()
        storage = torch.UntypedStorage(nbytes, device="cpu")
        return storage.pin_memory() if pinned else storage

    def release(self, storages: list[torch.UntypedStorage]) -> None:
        """Keep ``storages`` (nothing may use them any more) for the next snapshot; drop the rest."""
        self._settle()
        self._free = {}
        for st in storages:
            self._free.setdefault((st.nbytes(), st.is_pinned()), []).append(st)

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes() for free in self._free.values() for st in free)


class HostCopy:
    """Copies nested state (dicts, lists, tuples, tensors, plain objects) into host memory, one file's state per
    call. Within a call an object met twice is copied once, and tensors that share a storage share its copy (views
    and tied weights stay tied), so ``torch.save`` writes the copy as it would have written the original;
    ``nbytes`` counts the bytes copied over all calls and ``storages`` holds the copies' storages (drawn from
    ``buffers`` when given). With ``deferred``, a call copies the structure and allocates the host memory but
    leaves the bytes for :meth:`copy_pending` (e.g. in a background thread while the next forward and backward,
    which change none of it, run)."""

    def __init__(self, buffers: HostBuffers | None = None, deferred: bool = False) -> None:
        self.nbytes = 0
        self.buffers, self.deferred = buffers, deferred
        self.storages: list[torch.UntypedStorage] = []
        self._pending: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = []
        self._ready: dict[torch.device, Any] = {}  # per GPU: an event after the work that made the sources
        self._storages: dict[tuple[str, int | None, int], torch.UntypedStorage] = {}
        self._memo: dict[int, Any] = {}

    def __call__(self, obj: Any) -> Any:
        # Identities are only meaningful while ``obj`` keeps its parts alive: memos last one call (DeepSpeed frees
        # one file's state before it builds the next, whose objects may reuse the addresses).
        self._storages, self._memo = {}, {}
        try:
            return self._copy(obj)
        finally:
            self._storages, self._memo = {}, {}
            for device in self._ready:  # after the work that made every source met so far (their producers may
                self._ready[device] = torch.cuda.Event()  # queue work between calls: the newest event covers all)
                self._ready[device].record(torch.cuda.current_stream(device))

    def _copy(self, obj: Any) -> Any:
        seen = self._memo.get(id(obj))
        if seen is not None:  # the same object twice stays one object (pickle writes it once, as for the original)
            return seen
        out: Any
        if isinstance(obj, torch.Tensor):
            out = self._tensor(obj)
        elif isinstance(obj, dict):
            out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict)
            self._memo[id(obj)] = out
            for k, v in obj.items():
                out[k] = self._copy(v)
        elif isinstance(obj, list):
            out = []
            self._memo[id(obj)] = out
            out.extend(self._copy(v) for v in obj)
        elif isinstance(obj, tuple):
            items = [self._copy(v) for v in obj]
            if all(a is b for a, b in zip(items, obj)):
                out = obj  # immutable all the way down: itself, as copy.deepcopy does
            else:
                out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        else:
            return copy.deepcopy(obj, self._memo)
        self._memo[id(obj)] = out
        return out

    def copy_pending(self) -> None:
        """With ``deferred``: copy the bytes of every storage met so far into its host copy (the sources were
        taken when met; until this returns, nothing may change them). A GPU's copies run on a stream of their own,
        after the work queued before the snapshot (an event recorded then), so they overlap the training thread's
        kernels instead of queueing between them on the default stream; this returns once they are done."""
        pending, self._pending = self._pending, []
        ready, self._ready = self._ready, {}
        streams: dict[torch.device, Any] = {}
        try:
            for dst, src in pending:
                if src.device.type != "cuda":
                    _bytes_of(dst).copy_(_bytes_of(src))  # a tensor's copy_ releases the GIL (a storage's does not)
                    continue
                stream = streams.get(src.device)
                if stream is None:
                    stream = streams[src.device] = torch.cuda.Stream(device=src.device)
                    stream.wait_event(ready[src.device])
                with torch.cuda.stream(stream):
                    _bytes_of(dst).copy_(_bytes_of(src), non_blocking=True)  # into pinned memory: a DMA
        finally:  # also after an error: no copy may still read a source once ``pending`` lets it go
            for stream in streams.values():
                stream.synchronize()

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        src = t.untyped_storage()
        key = (src.device.type, src.device.index, src.data_ptr())
        dst = self._storages.get(key) if src.nbytes() else None
        if dst is None:
            pinned = src.device.type == "cuda"  # a device-to-host copy from pinned memory is a plain DMA
            dst = (
                self.buffers.take(src.nbytes(), pinned)
                if self.buffers is not None
                else torch.UntypedStorage(src.nbytes(), device="cpu")
            )
            if self.deferred:  # the structure is copied now, the bytes by :meth:`copy_pending`
                self._pending.append((dst, src))
                if src.device.type == "cuda":
                    self._ready.setdefault(src.device, None)  # recorded at the end of the call
            else:
                dst.copy_(src)
            self._storages[key] = dst
            self.storages.append(dst)
            self.nbytes += src.nbytes()
        out = torch.empty((0,), dtype=t.dtype).set_(dst, t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=t.requires_grad)
        if t.requires_grad:  # torch.save records the flag (of a leaf or not): the file stays the same
            out.requires_grad_(True)
        return out


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The bytes of ``storage`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


@dataclass
class FileJob:
    """Writes some of a snapshot's files from host memory (``run`` is called once, in the background)."""

    paths: list[Path]
    run: Callable[[], Any]
    hashes: bool = False
    """``run`` returns the sha256 of the files it wrote, taken as it wrote them (:func:`save_hashed`), or None."""


def save_hashed(
    save: Callable[[Any, Any], None], state: Any, path: Path, into_file: bool, direct: bool = True
) -> dict[Path, str] | None:
    """``save(state, target)`` (a checkpoint engine's save of one file) into ``path``; when ``into_file`` (the
    save accepts an open file), through a :class:`HashingFile` (with direct I/O when ``direct``), and then
    returns ``{path: sha256}`` (hashed as it was written, never read back); otherwise into the path, returning
    None."""
    if not into_file:
        save(state, str(path))
        return None
    with HashingFile(path, direct) as f:
        save(state, f)
        return {path: f.close()}


@dataclass
class Snapshot:
    """One rank's files of one checkpoint: those already on disk (``written``) and those still in host memory
    (``jobs``); ``nbytes`` is the host memory they hold (the tensors copied)."""

    stage: Path
    written: list[Path] = field(default_factory=list)
    jobs: list[FileJob] = field(default_factory=list)
    nbytes: int = 0
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    """The host memory the jobs' state lives in (for :meth:`HostBuffers.release` once written)."""
    deferred_copy: Callable[[], None] | None = None
    """Copies into host memory left for later (:meth:`HostCopy.copy_pending`): :meth:`finish_copy` runs them."""
    digests: store.Digests = field(init=False)
    """Sizes, checksums and fsyncs of this rank's files, each started as soon as the file is written."""
    copied: threading.Event = field(init=False)
    """Set once the snapshot no longer reads the live state (its deferred copies are done, or failed)."""

    def __post_init__(self) -> None:
        self.digests = store.Digests(self.stage)
        self.copied = threading.Event()

    def finish_copy(self) -> None:
        """Run the deferred copies, if any (then the live state may change again: :attr:`copied`)."""
        try:
            if self.deferred_copy is not None:
                self.deferred_copy()
                self.deferred_copy = None
        finally:
            self.copied.set()

    def write(self) -> dict[str, FileEntry]:
        """Write every job's files (each job's memory is released once written); each written file is hashed and
        fsynced while the next is written (:class:`store.Digests`). Returns every file's entry of this rank."""
        try:
            self.finish_copy()
            self.digests.add(self.written)
            while self.jobs:
                job = self.jobs.pop(0)
                hashed = job.run()
                self.digests.add(job.paths, hashed if job.hashes else None)
                del job
            self.nbytes = 0
            return self.digests.result()
        finally:
            self.digests.close()


class BackgroundWrite:
    """:meth:`Snapshot.write` in a daemon thread (a killed job leaves only its staging directory, which no reader
    sees). ``delay_s`` sleeps first (``faults.slow_checkpoint_at_step``). After :meth:`done`, ``digests`` holds
    the result or ``error`` the one-line failure."""

    def __init__(self, snapshot: Snapshot, step: int, delay_s: float = 0.0) -> None:
        self.snapshot, self.step, self.delay_s = snapshot, step, delay_s
        self.nbytes = snapshot.nbytes
        self.storages = snapshot.storages  # reusable once written (``done``)
        self.digests: dict[str, FileEntry] = {}
        self.error: str | None = None
        self.seconds = 0.0  # the write, hash and fsync (the delay excluded)
        self.copy_s = 0.0  # the deferred copies to host memory
        self.copied = snapshot.copied
        self._thread = threading.Thread(target=self._run, name=f"checkpoint-write-{step}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            self.snapshot.finish_copy()  # first: the loop's next update waits for it, not for the delay
            self.copy_s = time.perf_counter() - t0
            if self.delay_s:
                time.sleep(self.delay_s)
            t0 = time.perf_counter()
            self.digests = self.snapshot.write()
            self.seconds = time.perf_counter() - t0
        except Exception as e:  # reported at the next step boundary, on every rank
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.snapshot = None  # type: ignore[assignment]  # the host copy is freed with the thread's frame

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait_copied(self) -> None:
        """Until the snapshot no longer reads the live state (its deferred copies are done)."""
        self.copied.wait()

    def wait(self) -> None:
        self._thread.join()
