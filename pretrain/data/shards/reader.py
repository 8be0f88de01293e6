"""Reading a token-shard directory by memory map: documents by index, and a training reader with an exact state.

:class:`ShardSet` maps the shards and the document index of a directory (opened once per process and source: the
files are checked against the manifest first, sizes and sampled sha256, :func:`format.check_files`). Document
``i`` is a view of the mapped tokens (a copy only when it spans two shards).

:class:`ShardReader` yields the documents as the records every source reader yields (see
:mod:`pretrain.data.sources`), with ``"text": None``, the tokens in ``"ids"`` and the text's CRC32 in ``"crc32"``
(the holdout's hash); its state is ``{"doc": documents read}``: one integer, exact after any document.
"""

from __future__ import annotations

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
            shard = self._shards[k] = np.load(self.directory / shard_name(k), mmap_mode="r")
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


class ShardReader:
    """The documents of a shard source in order, as records (see the module docstring)."""

    def __init__(self, shards: ShardSet, name: str, state: dict | None = None):
        self.shards, self.name = shards, name
        self.doc = int((state or {}).get("doc", 0))
        self._where = str(shards.directory)

    def state_dict(self) -> dict:
        return {"doc": self.doc}

    def close(self) -> None:
        pass

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        i = self.doc
        if i >= len(self.shards):
            raise StopIteration
        self.doc += 1
        return {
            "text": None,
            "ids": self.shards.document(i),
            "crc32": int(self.shards.crc32[i]),
            "bad": None,
            "msg": "",
            "file": self._where,
            "line": i,
        }
