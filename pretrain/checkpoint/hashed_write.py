"""Writing one checkpoint file and its sha256 in one pass: :class:`HashingFile` hashes what is written as it is
written (its writer never reads the file back) and, where the filesystem allows, writes it with direct I/O
(``O_DIRECT``: from a few reused, page-aligned buffers straight to the device, past the page cache).

Why direct I/O: a buffered write of a large checkpoint first fills fresh page-cache pages, and where fresh pages
are slow to come by (memory pressure, some VMs) its speed varies widely from one write to the next, with the pages
at hand or not; the same bytes with ``O_DIRECT`` go at a steady speed every time. The write-back of those pages
then competes with the next files. Direct writes reuse the same few buffers and leave nothing dirty behind; the
fsync that commits the file only has the metadata left. A filesystem that refuses ``O_DIRECT`` (tmpfs, some
network or overlay filesystems) gets buffered writes, transparently (refused at open: a buffered file; at a write:
the descriptor drops ``O_DIRECT`` and writes on).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pretrain.checkpoint.hash_tally import count_hashed

CHUNK = 16 << 20
"""Bytes per direct write (a multiple of any logical block size)."""
ALIGN = 4096
"""Direct I/O alignment of buffer addresses, lengths and offsets (mmap'ed buffers are page-aligned)."""
_PARALLEL_FROM = 1 << 20
"""Buffered mode: smaller writes are hashed inline, larger ones on the helper thread while written."""


def _open_direct(path: Path) -> int | None:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise


def _drop_direct(fd: int) -> bool:
    """Clear ``O_DIRECT`` on an open descriptor; False when it was not set."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & os.O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
    return True


class HashingFile:
    """A new binary file (write-only, sequential) that sha256-hashes what is written into it as it goes.
    ``torch.save`` writes into it like into any buffer (the zip format only calls ``write`` and ``flush``).
    :meth:`close` returns the hex digest; the hashing is counted in :func:`~pretrain.checkpoint.hash_tally.hash_tally`.

    With ``direct`` (and a filesystem that accepts it) the bytes are gathered into page-aligned buffers of
    :data:`CHUNK` bytes; each full buffer is hashed on one helper thread and written with ``O_DIRECT`` on
    another while the next buffer fills (three buffers in a ring); the last, partial one is written padded to
    :data:`ALIGN` and the file truncated to its length. Otherwise: buffered writes, each large one hashed on a
    helper thread while this thread writes the same memory (``hashlib`` and the write both release the GIL)."""

    def __init__(self, path: Path, direct: bool = True) -> None:
        self.path = Path(path)
        self._hash = hashlib.sha256()
        self.nbytes, self.hash_s = 0, 0.0
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash-stream")
        self._fd = _open_direct(self.path) if direct else None
        self.direct = self._fd is not None
        self._file = None if self.direct else open(self.path, "wb")
        if self.direct:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-direct-write")
            self._ring = [mmap.mmap(-1, CHUNK) for _ in range(3)]
            self._busy: list[list[Future]] = [[] for _ in self._ring]
            self._slot, self._fill, self._offset = 0, 0, 0

    # -- writing -------------------------------------------------------------------------------------

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if self.direct:
            self._gather(view)
        elif n < _PARALLEL_FROM:
            self._update(view)
            assert self._file is not None  # not direct: a buffered file
            self._file.write(view)
        else:
            assert self._file is not None  # not direct: a buffered file
            hashed = self._hasher.submit(self._update, view)
            try:
                self._file.write(view)  # a buffered binary file writes all of it or raises
            finally:
                hashed.result()
        self.nbytes += n
        return n

    def _gather(self, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            buf = self._ring[self._slot]
            take = min(CHUNK - self._fill, view.nbytes - done)
            buf[self._fill : self._fill + take] = view[done : done + take]
            self._fill += take
            done += take
            if self._fill == CHUNK:
                self._emit(CHUNK)

    def _emit(self, length: int) -> None:
        """Hand the current buffer's first ``length`` bytes to the hash and write threads; move to the next
        buffer of the ring (waiting until its previous contents are hashed and written)."""
        buf, offset = memoryview(self._ring[self._slot]), self._offset
        padded = -(-length // ALIGN) * ALIGN
        self._busy[self._slot] = [
            self._hasher.submit(self._update, buf[:length]),
            self._writer.submit(self._write_at, buf[:padded], offset),
        ]
        self._offset += length
        self._slot = (self._slot + 1) % len(self._ring)
        self._fill = 0
        self._settle(self._slot)

    def _settle(self, slot: int) -> None:
        busy, self._busy[slot] = self._busy[slot], []
        for f in busy:
            f.result()

    def _write_at(self, buf: memoryview, offset: int) -> None:
        assert self._fd is not None  # direct: open until _release, which waits for the writes
        done = 0
        while done < buf.nbytes:
            try:
                done += os.pwrite(self._fd, buf[done:], offset + done)
            except OSError as e:  # opened, yet a direct write refused (e.g. a larger alignment): write through
                if e.errno != errno.EINVAL or not _drop_direct(self._fd):
                    raise

    def _update(self, view: memoryview) -> None:
        t0 = time.perf_counter()
        self._hash.update(view)
        self.hash_s += time.perf_counter() - t0

    def flush(self) -> None:
        if not self.direct:
            assert self._file is not None  # not direct: a buffered file
            self._file.flush()

    # -- closing -------------------------------------------------------------------------------------

    def close(self) -> str:
        """Write what is left, close the file and return its sha256 (hex)."""
        try:
            if self.direct:
                if self._fill:
                    self._emit(self._fill)
                for slot in range(len(self._ring)):
                    self._settle(slot)
                assert self._fd is not None  # direct: open until _release
                os.ftruncate(self._fd, self._offset)  # the last direct write was padded
        finally:
            self._release()
        count_hashed(self.nbytes, self.hash_s)
        return self._hash.hexdigest()

    def _release(self) -> None:
        if self.direct:
            if self._fd is not None:
                for slot in range(len(self._ring)):
                    for f in self._busy[slot]:
                        f.exception()  # wait; a failure was (or will be) raised by close or write
                os.close(self._fd)
                self._fd = None
                self._writer.shutdown()
        else:
            assert self._file is not None  # not direct: a buffered file
            if not self._file.closed:
                self._file.close()
        self._hasher.shutdown()

    def __enter__(self) -> HashingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release()  # after a failed write: close without a digest (closing twice is harmless)
