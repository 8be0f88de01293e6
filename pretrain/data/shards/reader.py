"""Reading a token-shard directory by memory map: documents by index, and a training reader with an exact state.

:class:`ShardSet` maps the shards and the document index of a directory (opened once per process and source: the
files are checked against the manifest first, sizes and sampled sha256, :func:`format.check_files`). Document
``i`` is a view of the mapped tokens (a copy only when it spans two shards).

:class:`ShardReader` yields the documents as the records every source reader yields (see
:mod:`pretrain.data.sources`), with ``"text": None``, the tokens in ``"ids"`` and the text's CRC32 in ``"crc32"``
(the holdout's hash); its state is ``{"doc": documents read}``: one integer, exact after any document. The tokens
are a callable (``"ids": load()``, :func:`tokens_of`): a virtual stream skips the documents of the other streams
without touching their tokens, and reads the index in blocks.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pretrain.data.shards.format import DOCUMENTS, DOCUMENTS_CRC, Manifest, check_files, load_manifest, shard_name


class ShardSet:
    """The documents of one shard directory, memory-mapped (see the module docstring)."""

    def __init__(self, directory: str | Path, manifest: Manifest | None = None, check: bool = True):
        self.directory = Path(directory)
        self.manifest = manifest or load_manifest(self.directory)
        if check:
            check_files(self.directory, self.manifest)
        m = self.manifest
        self.shard_tokens = m.shard_tokens
        self.ends = np.load(self.directory / DOCUMENTS, mmap_mode="r")
        self.crc32 = np.load(self.directory / DOCUMENTS_CRC, mmap_mode="r")
        self._shards: list[np.ndarray | None] = [None] * len(m.shards)

    def __len__(self) -> int:
        return int(self.manifest.documents)

    def _shard(self, k: int) -> np.ndarray:
        shard = self._shards[k]
        if shard is None:
            # a plain ndarray over the mapping: slicing a np.memmap costs a Python-level __array_finalize__ per slice
            shard = self._shards[k] = np.load(self.directory / shard_name(k), mmap_mode="r").view(np.ndarray)
        return shard

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Global tokens ``[start, end)``."""
        N = self.shard_tokens
        k, off = divmod(start, N)
        if end - start <= N - off:
            return self._shard(k)[off : off + end - start]
        pieces = []
        while start < end:
            k, off = divmod(start, N)
            take = min(N - off, end - start)
            pieces.append(self._shard(k)[off : off + take])
            start += take
        return np.concatenate(pieces)

    def document(self, i: int) -> np.ndarray:
        start = int(self.ends[i - 1]) if i > 0 else 0
        return self.tokens(start, int(self.ends[i]))


INDEX_BLOCK = 8192
"""Index entries (document ends and CRC32s) read at a time by a :class:`ShardReader`."""


def tokens_of(row: dict) -> np.ndarray:
    """The tokens of a record of a :class:`ShardReader`."""
    return row["ids"]()


class ShardReader:
    """The documents of a shard source in order, as records (see the module docstring)."""

    def __init__(self, shards: ShardSet, name: str, state: dict | None = None):
        self.shards, self.name = shards, name
        self.doc = int((state or {}).get("doc", 0))
        self._where = str(shards.directory)
        self._block = -1
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._crcs: list[int] = []
        self._kept_key: tuple | None = None
        self._kept_list: list[int] = []

    def _load_block(self, block: int) -> None:
        a = block * INDEX_BLOCK
        b = min(a + INDEX_BLOCK, len(self.shards))
        ends = self.shards.ends[max(a - 1, 0) : b].tolist()  # with the end of the block's previous document
        self._ends = ends[1:] if a > 0 else ends
        self._starts = ([ends[0]] if a > 0 else [0]) + self._ends[:-1]
        self._crcs = self.shards.crc32[a:b].tolist()
        self._block = block

    def state_dict(self) -> dict:
        return {"doc": self.doc}

    def next_kept(self, holdout: float, want_val: bool, skip: int) -> tuple[Callable[[], np.ndarray] | None, int]:
        """Pass ``skip`` documents of the role (held out iff ``want_val``; all when ``holdout`` is 0), then take the
        next: (its tokens' loader, or None when the documents ended first; documents of the role passed, the one
        taken included). What :class:`~pretrain.data.stream.DocumentStream` does record by record over a single
        shard source, a block of the index at a time."""
        passed, n = 0, len(self.shards)
        while self.doc < n:
            block, k = divmod(self.doc, INDEX_BLOCK)
            if block != self._block:
                self._load_block(block)
            kept = self._kept(holdout, want_val)
            j = bisect.bisect_left(kept, k)
            if len(kept) - j > skip - passed:
                pos = kept[j + skip - passed]
                self.doc = block * INDEX_BLOCK + pos + 1
                return functools.partial(self.shards.tokens, self._starts[pos], self._ends[pos]), skip + 1
            passed += len(kept) - j
            self.doc = min((block + 1) * INDEX_BLOCK, n)
        return None, passed

    def _kept(self, holdout: float, want_val: bool) -> list[int]:
        key = (self._block, holdout, want_val)
        if self._kept_key != key:
            crc = np.asarray(self._crcs, dtype=np.int64)
            keep = (crc % 1_000_000 < holdout * 1_000_000) == want_val if holdout > 0 else np.ones(len(crc), bool)
            self._kept_list, self._kept_key = np.flatnonzero(keep).tolist(), key
        return self._kept_list

    def close(self) -> None:
        pass

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        i = self.doc
        if i >= len(self.shards):
            raise StopIteration
        self.doc += 1
        block, k = divmod(i, INDEX_BLOCK)
        if block != self._block:
            self._load_block(block)
        return {
            "text": None,
            "ids": functools.partial(self.shards.tokens, self._starts[k], self._ends[k]),
            "crc32": self._crcs[k],
            "bad": None,
            "msg": "",
            "file": self._where,
            "line": i,
        }
