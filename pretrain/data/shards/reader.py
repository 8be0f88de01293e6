"""Reading a token-shard directory by memory map: documents by index, and a training reader with an exact state.

:class:`ShardSet` maps the shards and the document index of a directory (opened once per process and source: the
files are checked against the manifest first, sizes and sampled sha256, :func:`format.check_files`). Document
``i`` is a view of the mapped tokens (a copy only when it spans two shards).

:class:`ShardReader` yields the documents as the records every source reader yields (see
:mod:`pretrain.data.sources`), with ``"text": None``, the tokens in ``"ids"`` and the text's CRC32 in ``"crc32"``
(the holdout's hash); its state is ``{"doc": documents read}``: one integer, exact after any document. The tokens
are a callable (``"ids": load()``, :func:`tokens_of`): a virtual stream skips the documents of the other streams
without touching their tokens, and reads the index in blocks.

:meth:`ShardReader.take_tokens` is the packer's bulk path over a single shard source: the documents of one virtual
stream, each followed by the separator, gathered from the mapping a block of the index at a time with one NumPy
fancy index, with no Python work per document. It leaves the reader (and returns the documents passed) exactly as
taking the same documents one at a time with :meth:`ShardReader.next_kept` would.
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
        # plain ndarrays over the mappings (as the shards below)
        self.ends = np.load(self.directory / DOCUMENTS, mmap_mode="r").view(np.ndarray)
        self.crc32 = np.load(self.directory / DOCUMENTS_CRC, mmap_mode="r").view(np.ndarray)
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
        if end <= start:  # a document of no tokens (at the very end, ``start`` is past the last shard)
            return self._shard(min(k, len(self._shards) - 1))[:0]
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
        self._starts_array = self._ends_array = self._crc_array = np.zeros(0, dtype=np.int64)
        self._lists: tuple[list[int], list[int], list[int]] | None = None  # the block's arrays as lists, when used
        self._kept_key: tuple | None = None
        self._kept_array = np.zeros(0, dtype=np.int64)
        self._kept_list: list[int] | None = None

    def _load_block(self, block: int) -> None:
        a = block * INDEX_BLOCK
        b = min(a + INDEX_BLOCK, len(self.shards))
        ends = np.array(self.shards.ends[max(a - 1, 0) : b], dtype=np.int64)  # with the previous block's last end
        if a > 0:
            self._starts_array, self._ends_array = ends[:-1], ends[1:]
        else:
            self._starts_array, self._ends_array = np.concatenate([[0], ends[:-1]]), ends
        self._crc_array = np.array(self.shards.crc32[a:b], dtype=np.int64)
        self._lists = None
        self._block = block

    def _block_lists(self) -> tuple[list[int], list[int], list[int]]:
        """The block's starts, ends and CRC32s as lists (the document-by-document path)."""
        if self._lists is None:
            self._lists = (self._starts_array.tolist(), self._ends_array.tolist(), self._crc_array.tolist())
        return self._lists

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
            kept = self._kept_as_list(holdout, want_val)
            j = bisect.bisect_left(kept, k)
            if len(kept) - j > skip - passed:
                pos = kept[j + skip - passed]
                self.doc = block * INDEX_BLOCK + pos + 1
                starts, ends, _ = self._block_lists()
                return functools.partial(self.shards.tokens, starts[pos], ends[pos]), skip + 1
            passed += len(kept) - j
            self.doc = min((block + 1) * INDEX_BLOCK, n)
        return None, passed

    def take_tokens(
        self, holdout: float, want_val: bool, skip: int, every: int, n_tokens: int, separator: int
    ) -> tuple[np.ndarray, int, bool]:
        """Documents of the role (see :meth:`next_kept`): pass ``skip``, take one, then one in ``every``, until the
        taken documents, each followed by ``separator``, hold at least ``n_tokens`` tokens or the documents end.
        Returns (their tokens, int64; documents of the role passed, the last taken included; whether the documents
        ended first)."""
        pieces: list[np.ndarray] = []
        got = passed = 0
        n = len(self.shards)
        while self.doc < n:
            block, k = divmod(self.doc, INDEX_BLOCK)
            if block != self._block:
                self._load_block(block)
            kept = self._kept(holdout, want_val)
            j = int(kept.searchsorted(k))
            left = len(kept) - j  # documents of the role from here to the end of the block
            if left <= skip:
                passed, skip = passed + left, skip - left
                self.doc = min((block + 1) * INDEX_BLOCK, n)
                continue
            # enough candidates for what is missing (twice the block's mean length's worth): more are taken next turn
            mean = max(1, (int(self._ends_array[-1]) - int(self._starts_array[0])) // len(self._ends_array))
            window = 16 + 2 * (n_tokens - got) // mean
            picks = kept[j + skip : j + skip + every * window : every]
            starts, ends = self._starts_array[picks], self._ends_array[picks]
            lengths = ends - starts + 1
            room = lengths.cumsum()
            m = min(int(room.searchsorted(n_tokens - got)) + 1, len(picks))
            pieces.append(self.gather(starts[:m], ends[:m], lengths[:m], room[:m], separator))
            got += int(room[m - 1])
            passed += skip + (m - 1) * every + 1
            self.doc, skip = block * INDEX_BLOCK + int(picks[m - 1]) + 1, every - 1
            if got >= n_tokens:
                return (pieces[0] if len(pieces) == 1 else np.concatenate(pieces)), passed, False
        return (np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)), passed, True

    def gather(
        self, starts: np.ndarray, ends: np.ndarray, lengths: np.ndarray, room: np.ndarray, separator: int
    ) -> np.ndarray:
        """Global token ranges ``[starts[i], ends[i])`` (in any order), each followed by ``separator``, as one int64
        array (``lengths``: the ranges' lengths plus one; ``room``: their running sum)."""
        N = self.shards.shard_tokens
        shard = min(int(starts.min()) // N, len(self.shards._shards) - 1)  # (documents of no tokens at the end)
        if int(ends.max()) > (shard + 1) * N:  # the ranges span shards: one range at a time
            sep = np.array([separator], dtype=np.int64)
            parts = [p for a, b in zip(starts.tolist(), ends.tolist()) for p in (self.shards.tokens(a, b), sep)]
            return np.concatenate(parts, dtype=np.int64)
        out_starts = room - lengths
        index = np.arange(int(room[-1]), dtype=np.int64) + (starts - shard * N - out_starts).repeat(lengths)
        seps = room - 1
        index[seps] = 0  # the separators' places (possibly one past the shard)
        out = self.shards._shard(shard)[index].astype(np.int64)
        out[seps] = separator
        return out

    def _kept(self, holdout: float, want_val: bool) -> np.ndarray:
        """The block's positions of the documents of the role."""
        key = (self._block, holdout, want_val)
        if self._kept_key != key:
            crc = self._crc_array
            keep = (crc % 1_000_000 < holdout * 1_000_000) == want_val if holdout > 0 else np.ones(len(crc), bool)
            self._kept_array, self._kept_list, self._kept_key = np.flatnonzero(keep), None, key
        return self._kept_array

    def _kept_as_list(self, holdout: float, want_val: bool) -> list[int]:
        kept = self._kept(holdout, want_val)
        if self._kept_list is None:
            self._kept_list = kept.tolist()
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
        starts, ends, crcs = self._block_lists()
        return {
            "text": None,
            "ids": functools.partial(self.shards.tokens, starts[k], ends[k]),
            "crc32": crcs[k],
            "bad": None,
            "msg": "",
            "file": self._where,
            "line": i,
        }
