"""The on-disk format of a token-shard directory: its files, its manifest, and the checks a reader makes.

A directory written by ``./launch.sh tokenize`` holds

* ``shard-00000.npy``, ``shard-00001.npy``, ...: the tokens of every document, concatenated in document order
  (no separator: the packer appends the tokenizer's eos after each document, as it does for text), cut into
  shards of exactly ``shard_tokens`` tokens (the last one shorter). Little-endian ``uint16`` when the
  tokenizer's vocabulary fits, else ``uint32``; NumPy ``.npy`` files, so ``numpy.load(mmap_mode="r")`` maps them.
* ``documents.npy``: the document index, one little-endian ``uint64`` per document, the global token offset where
  the document ends (document ``i`` is the tokens ``[ends[i-1], ends[i])``, ``ends[-1] == tokens``).
* ``documents_crc32.npy``: one ``uint32`` per document, ``zlib.crc32`` of the document's UTF-8 text: the
  validation holdout chooses documents by it, exactly as it does for text sources.
* ``tokenizer/``: the tokenizer the shards were made with (a saved Hugging Face fast tokenizer).
* ``manifest.json`` (written last: a directory without it is not a shard directory): the format and its
  version, the dtype, the sources' fingerprints and counts, the tokenizer's sha256 (:func:`tokenizer_hash`) and
  vocabulary size, token and document counts, and every file's size, sha256 and sampled sha256.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.config import ConfigError
from pretrain.config.errors import clip

FORMAT = "pretrain-token-shards"
FORMAT_VERSION = 1
"""The version this code writes and the newest it reads."""
MANIFEST = "manifest.json"
DOCUMENTS = "documents.npy"
DOCUMENTS_CRC = "documents_crc32.npy"
TOKENIZER_DIR = "tokenizer"
DEFAULT_SHARD_TOKENS = 1 << 27
"""Tokens per shard by default (128 Mi: 256 MiB of uint16)."""
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class ShardError(ConfigError):
    """A token-shard directory that cannot be used (corrupt, truncated, newer format...): one line, exit 2."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.npy"


def dtype_for(vocab_size: int) -> str:
    """``uint16`` when every id of a vocabulary of ``vocab_size`` fits, else ``uint32``."""
    if vocab_size <= 0:
        raise ValueError(f"vocabulary size must be > 0, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ValueError(f"a vocabulary of {vocab_size:,} tokens does not fit uint32 token ids")


def npy_bytes(dtype: str, count: int) -> int:
    """The size of a 1-D little-endian ``.npy`` file of ``count`` elements, header included (what ``np.save``
    writes)."""
    f = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(DTYPES[dtype]), "fortran_order": False, "shape": (count,)}
    np.lib.format.write_array_header_1_0(f, header)
    return f.tell() + DTYPES[dtype].itemsize * count


def tokenizer_hash(tokenizer_dir: str | Path) -> str:
    """The sha256 of a saved fast tokenizer's ``tokenizer.json`` as the ``tokenizers`` library serializes it (so
    the same tokenizer saved twice hashes the same)."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir) / "tokenizer.json"
    try:
        text = Tokenizer.from_file(str(path)).to_str()
    except Exception as e:  # noqa: BLE001 - a missing or unreadable file: one line
        raise ConfigError(f"{clip(str(path))}: not a fast tokenizer ({clip(str(e) or type(e).__name__)})") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class FileRecord:
    """One file of the directory as the manifest records it."""

    file: str
    bytes: int
    sha256: str
    sampled_sha256: str
    tokens: int = 0
    """Tokens (shards) or documents (the index files)."""


@dataclass
class Manifest:
    dtype: str
    shard_tokens: int
    tokens: int
    documents: int
    tokenizer: dict[str, Any]
    """``{"sha256": tokenizer_hash, "vocab_size": len(tokenizer)}``."""
    sources: list[dict[str, Any]]
    """Per source: ``path``, ``format``, ``text_field``, ``fingerprint`` (:mod:`pretrain.data.fingerprint`),
    ``documents``, ``tokens``, ``bad_records``."""
    shards: list[FileRecord]
    index: list[FileRecord]
    bad_records: dict[str, Any] = field(default_factory=dict)
    """The bad records the job skipped, as training reports them (``total``, ``by_reason``, ``examples``)."""
    job: dict[str, Any] = field(default_factory=dict)
    """What the output depends on (sources, tokenizer, shard and unit sizes): a rerun of another job is refused."""
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def file_record(path: Path, tokens: int = 0) -> FileRecord:
    """Size, full sha256 and sampled sha256 (:func:`pretrain.data.fingerprint.file_fingerprint`) of one file."""
    from pretrain.data.file_hash import file_fingerprint, full_sha256

    return FileRecord(
        path.name, path.stat().st_size, full_sha256(str(path)), file_fingerprint(str(path))["sampled_sha256"], tokens
    )


def is_shard_dir(path: str | Path) -> bool:
    """``path`` holds a ``manifest.json`` that ``./launch.sh tokenize`` wrote (its format field), not merely a file
    of that name; its version and fields are checked when it is loaded (:func:`load_manifest`)."""
    try:
        raw = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


def load_manifest(directory: str | Path) -> Manifest:
    """The manifest of ``directory``, its format version and fields checked; :class:`ShardError` in one line."""
    path = Path(directory) / MANIFEST
    where = clip(str(path))
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ShardError(f"{where}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise ShardError(f"{where}: not valid JSON ({clip(str(e))})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ShardError(f"{where}: not a token-shard manifest (format is not {FORMAT!r})")
    version = raw.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ShardError(
            f"{where}: format version {version} is newer than this code reads (up to {FORMAT_VERSION}); "
            "update pretrain or tokenize again"
        )
    try:
        m = Manifest(
            **{
                **raw,
                "shards": [FileRecord(**r) for r in raw["shards"]],
                "index": [FileRecord(**r) for r in raw["index"]],
            }
        )
    except (KeyError, TypeError) as e:
        raise ShardError(f"{where}: malformed manifest ({clip(str(e))})") from None
    if m.dtype not in DTYPES:
        raise ShardError(f"{where}: dtype {m.dtype!r} is not one of {', '.join(DTYPES)}")
    vocab = int(m.tokenizer.get("vocab_size", 0))
    if vocab > np.iinfo(DTYPES[m.dtype]).max + 1:
        raise ShardError(f"{where}: a vocabulary of {vocab:,} tokens overflows the shards' dtype {m.dtype}")
    return m


def check_files(directory: str | Path, m: Manifest, full: bool = False) -> None:
    """Every file the manifest lists is there with its size and (sampled, or with ``full`` whole) sha256; the
    first that is not raises :class:`ShardError` naming it with the expected and found value."""
    from pretrain.data.file_hash import file_fingerprint

    d = Path(directory)
    for rec in [*m.index, *m.shards]:
        path = d / rec.file
        where = clip(str(path))
        try:
            size = path.stat().st_size
        except OSError:
            raise ShardError(f"{where}: missing (the manifest lists it; tokenize again)") from None
        if size != rec.bytes:
            kind = "truncated" if size < rec.bytes else "too long"
            raise ShardError(f"{where}: {kind}: {size:,} bytes, the manifest says {rec.bytes:,}")
        found = file_record(path).sha256 if full else file_fingerprint(str(path))["sampled_sha256"]
        expected = rec.sha256 if full else rec.sampled_sha256
        if found != expected:
            what = "sha256" if full else "sampled sha256"
            raise ShardError(f"{where}: corrupted: {what} {found[:16]}..., the manifest says {expected[:16]}...")
