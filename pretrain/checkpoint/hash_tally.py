"""What this process has hashed of checkpoint files (bytes and seconds), whichever thread hashed them: saves hash as
they write (``hashed_write``) or after (``store.Digests``), resume verification reads files back. ``bench
--checkpoint`` and the checkpoint metrics report it per rank (:mod:`pretrain.train.callbacks.checkpoint_stats`)."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HashTally:
    """Bytes this process has hashed (:func:`sha256_file`, or while writing: ``hashed_write``) and the seconds it
    took (its checkpoint hashing: saves and resume verification), so a run can report what each rank hashed
    (``bench --checkpoint``)."""

    bytes: int = 0
    seconds: float = 0.0

    def __sub__(self, other: HashTally) -> HashTally:
        return HashTally(self.bytes - other.bytes, self.seconds - other.seconds)


_tally = HashTally()
_tally_lock = threading.Lock()  # a background save hashes in another thread


def hash_tally() -> HashTally:
    """What this process has hashed so far; the difference of two readings is what was hashed in between."""
    with _tally_lock:
        return _tally


def sha256_file(path: Path) -> str:
    h, n, t0 = hashlib.sha256(), 0, time.perf_counter()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    count_hashed(n, time.perf_counter() - t0)
    return h.hexdigest()


def count_hashed(nbytes: int, seconds: float) -> None:
    """Add to :func:`hash_tally` (a file hashed elsewhere, e.g. while it was written)."""
    global _tally
    with _tally_lock:
        _tally = HashTally(_tally.bytes + nbytes, _tally.seconds + seconds)
