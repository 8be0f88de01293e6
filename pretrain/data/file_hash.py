"""A file's fingerprint: its size, modification time and the sha256 of sampled blocks (a fixed read per file, whatever
its size). Used by :mod:`pretrain.data.fingerprint` (a run's sources) and :mod:`pretrain.data.shards` (every file of a
shard directory). No imports from the rest of the package."""

from __future__ import annotations

import hashlib
import os
from typing import Any

BLOCK = 64 * 1024
BLOCKS = 16
"""Blocks of ``BLOCK`` bytes hashed per file (a file up to ``BLOCK * BLOCKS`` bytes is hashed whole)."""


def file_fingerprint(path: str) -> dict[str, Any]:
    """Size, modification time and the sha256 of ``BLOCKS`` sampled blocks of one file."""
    st = os.stat(path)
    digest = hashlib.sha256(str(st.st_size).encode())
    with open(path, "rb") as f:
        if st.st_size <= BLOCK * BLOCKS:
            digest.update(f.read())
        else:
            step = (st.st_size - BLOCK) / (BLOCKS - 1)
            for i in range(BLOCKS):
                f.seek(round(i * step))
                digest.update(f.read(BLOCK))
    return {"size": st.st_size, "mtime": st.st_mtime, "sampled_sha256": digest.hexdigest()}


def full_sha256(path: str) -> str:
    """The sha256 of the whole file (read in 4 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
