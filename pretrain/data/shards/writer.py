"""Writing a token-shard directory from the parts of a tokenize job (:mod:`pretrain.data.shards.units`).

:func:`assemble` concatenates the parts in unit order and cuts the tokens into shards of exactly
``shard_tokens`` tokens (the last one shorter), then writes the document index, the tokenizer and, last, the
manifest. Every file is written to a temporary name, flushed to disk and renamed, so a reader never sees half a
file; a shard already there with the bytes it would get is left alone (a rerun after a crash writes the
missing shards only). A directory has a manifest only once everything it lists is in place.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data.shards.format import (
    DOCUMENTS,
    DOCUMENTS_CRC,
    DTYPES,
    MANIFEST,
    TOKENIZER_DIR,
    FileRecord,
    Manifest,
    ShardError,
    file_record,
    shard_name,
)
from pretrain.data.shards.units import Unit, load_part


def npy_payload(array: np.ndarray) -> bytes:
    """The bytes ``np.save`` writes for ``array``."""
    f = io.BytesIO()
    np.save(f, array, allow_pickle=False)
    return f.getvalue()


def write_atomic(path: Path, data: bytes) -> bool:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename; False (nothing written) when the
    file already holds exactly ``data``."""
    if path.is_file() and path.stat().st_size == len(data):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        if digest.digest() == hashlib.sha256(data).digest():
            return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return True


def write_shards(
    out: Path, parts: Iterable[np.ndarray], dtype: str, shard_tokens: int, say: Callable[[str], None] = print
) -> list[FileRecord]:
    """The token arrays ``parts`` (in order) as fixed-size shards in ``out``; returns their records."""
    if shard_tokens <= 0:
        raise ValueError(f"--shard-tokens must be > 0, got {shard_tokens}")
    np_dtype = DTYPES[dtype]
    buf = np.empty(shard_tokens, dtype=np_dtype)
    fill = 0
    records: list[FileRecord] = []
    written = 0

    def emit(n: int) -> None:
        nonlocal written
        path = out / shard_name(len(records))
        written += write_atomic(path, npy_payload(buf[:n]))
        records.append(file_record(path, n))

    for tokens in parts:
        start = 0
        while start < tokens.size:
            take = min(shard_tokens - fill, tokens.size - start)
            buf[fill : fill + take] = tokens[start : start + take]
            fill, start = fill + take, start + take
            if fill == shard_tokens:
                emit(fill)
                fill = 0
    if fill or not records:
        emit(fill)
    say(f"{len(records)} shard(s), {written} written, {len(records) - written} already in place")
    return records


def write_index(out: Path, lengths: np.ndarray, crcs: np.ndarray) -> list[FileRecord]:
    """The document index (cumulative ends, uint64) and the documents' text CRC32s."""
    ends = np.cumsum(lengths.astype("<u8"), dtype="<u8")
    write_atomic(out / DOCUMENTS, npy_payload(ends))
    write_atomic(out / DOCUMENTS_CRC, npy_payload(crcs.astype("<u4")))
    return [file_record(out / DOCUMENTS, len(ends)), file_record(out / DOCUMENTS_CRC, len(crcs))]


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    """The tokenizer's files into ``out/tokenizer`` (replaced as a whole, through a temporary directory)."""
    dest = out / TOKENIZER_DIR
    tmp = out / f".{TOKENIZER_DIR}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tokenizer_dir, tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def write_manifest(out: Path, manifest: Manifest) -> None:
    """The manifest, last (atomically): the directory becomes a shard directory."""
    write_atomic(out / MANIFEST, manifest.to_json().encode())


def assemble(
    out: Path,
    work: Path,
    units: list[Unit],
    *,
    dtype: str,
    shard_tokens: int,
    tokenizer_dir: Path,
    tokenizer: dict[str, Any],
    sources: list[dict[str, Any]],
    bad_records: dict[str, Any] | None = None,
    job: dict[str, Any] | None = None,
    say: Callable[[str], None] = print,
) -> Manifest:
    """The finished parts of ``units`` (in ``work``) as the token-shard directory ``out``: shards, index, tokenizer,
    then the manifest. An output without a single document is refused (:class:`ShardError`); nothing is written."""
    lengths = np.concatenate([load_part(work, u)[1] for u in units]) if units else np.zeros(0, np.uint64)
    tokens = int(lengths.sum())
    if len(lengths) == 0 or tokens == 0:
        raise ShardError(f"tokenize: no documents to write into {out} (every record was bad or empty)")
    vocab = int(tokenizer["vocab_size"])
    if vocab > np.iinfo(DTYPES[dtype]).max + 1:
        raise ShardError(f"tokenize: a vocabulary of {vocab:,} tokens overflows the dtype {dtype}")
    out.mkdir(parents=True, exist_ok=True)
    crcs = np.concatenate([load_part(work, u)[2] for u in units])
    shards = write_shards(out, (load_part(work, u)[0] for u in units), dtype, shard_tokens, say)
    index = write_index(out, lengths, crcs)
    copy_tokenizer(tokenizer_dir, out)
    manifest = Manifest(
        dtype=dtype,
        shard_tokens=shard_tokens,
        tokens=tokens,
        documents=len(lengths),
        tokenizer=dict(tokenizer),
        sources=sources,
        shards=shards,
        index=index,
        bad_records=bad_records or {},
        job=job or {},
    )
    write_manifest(out, manifest)
    return manifest
