"""The work of a tokenize job, cut into units that any worker can do alone, in any order, with the same result.

A *unit* is a byte range of a txt/jsonl file that starts and ends at line boundaries (files larger than
``chunk_bytes`` are cut into several), one parquet file, or a hub dataset's split (one unit: a stream has no
ranges). Units are numbered in document order (sources in the order given, files in their sorted order, ranges in
file order), so the concatenation of the units' documents in unit order is the order a training reader of the same
sources sees, and the shards do not depend on how many workers did the units.

:func:`tokenize_unit` reads a unit's records with the training readers' parsing
(:func:`pretrain.data.sources.parse_line`, :meth:`ResolvedSource.open_part` / ``convert``), encodes the good ones
with the tokenizer's batch encoder and writes the unit's *part* file: its tokens, document lengths and text CRC32s
(``part-NNNNNN.npz``, written to a temporary name and renamed), then its summary (``part-NNNNNN.json``: counts and
bad records, with lines counted from the unit's start). A unit whose summary exists is done: a rerun after a
crash skips it.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data.shards.format import DTYPES, dtype_for
from pretrain.data.sources import ResolvedSource, parse_line

DEFAULT_CHUNK_BYTES = 64 << 20
ENCODE_BATCH = 512
"""Documents encoded per call of the batch encoder."""


@dataclass(frozen=True)
class Unit:
    index: int
    source: int
    """Index of the source in the job's list."""
    part: int = 0
    """The parquet file (``ResolvedSource.files[part]``) of a parquet unit."""
    file: str = ""
    """The txt/jsonl file of a byte-range unit."""
    start: int = 0
    end: int = 0


def _line_starts(file: str, chunk_bytes: int) -> list[int]:
    """Byte offsets that cut ``file`` into ranges of about ``chunk_bytes``, each at the start of a line."""
    size = os.path.getsize(file)
    cuts = [0]
    with open(file, "rb") as f:
        pos = chunk_bytes
        while pos < size:
            f.seek(pos - 1)
            f.readline()  # to the end of the line that holds byte pos - 1
            cut = f.tell()
            if cut >= size:
                break
            if cut > cuts[-1]:
                cuts.append(cut)
            pos = max(cut, pos) + chunk_bytes
    return [*cuts, size]


def plan_units(sources: list[ResolvedSource], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Unit]:
    """Every unit of ``sources``, numbered in document order."""
    units: list[Unit] = []
    for i, src in enumerate(sources):
        if src.format in ("text", "json"):
            for file in src.files:
                cuts = _line_starts(file, chunk_bytes)
                for a, b in zip(cuts, cuts[1:], strict=False):
                    units.append(Unit(len(units), i, file=file, start=a, end=b))
        else:
            for part in range(src.num_parts):
                units.append(Unit(len(units), i, part=part))
    return units


def _records(unit: Unit, src: ResolvedSource, lines: list[int]):
    """The unit's records (dicts as the training readers make them); line numbers count from the unit's start
    (1-based) for txt/jsonl, rows from the file's start for parquet. ``lines[0]`` counts the lines read."""
    if src.format in ("text", "json"):
        with open(unit.file, "rb") as f:
            f.seek(unit.start)
            pos, lineno = unit.start, 0
            while pos < unit.end:
                raw = f.readline()
                if not raw:
                    break
                pos += len(raw)
                lineno += 1
                lines[0] = lineno
                # parse_line drops a UTF-8 BOM on line 1 of a file only: a later range's first line is not one
                record = parse_line(
                    raw, lineno if unit.start == 0 else lineno + 1, src.format, src.text_field, unit.file
                )
                if record is not None:
                    yield {**record, "line": lineno}
        return
    for index, row in enumerate(src.open_part(unit.part)):
        yield src.convert(row, unit.part, index)


def part_paths(work: Path, unit: Unit) -> tuple[Path, Path]:
    """(the tokens file, the summary file) of a unit under the job's work directory."""
    return work / f"part-{unit.index:06d}.npz", work / f"part-{unit.index:06d}.json"


def unit_done(work: Path, unit: Unit) -> dict[str, Any] | None:
    """The summary of a finished unit (its tokens file present), or None."""
    tokens, summary = part_paths(work, unit)
    try:
        done = json.loads(summary.read_text())
    except (OSError, ValueError):
        return None
    return done if tokens.is_file() and done.get("unit") == asdict(unit) else None


def tokenize_unit(unit: Unit, src: ResolvedSource, encode, work: Path, vocab_size: int) -> dict[str, Any]:
    """Tokenize one unit into its part file (see the module docstring); returns its summary: ``documents``,
    ``tokens``, ``bad`` (``[[file, line, reason, message], ...]``, all of them) and ``lines`` (of a byte range)."""
    dtype = DTYPES[dtype_for(vocab_size)]  # the shards' dtype: parts are no larger than the shards
    lengths: list[int] = []
    crcs: list[int] = []
    chunks: list[np.ndarray] = []
    bad: list[list] = []
    texts: list[str] = []
    lines = [0]

    def flush() -> None:
        for ids in encode(texts):
            a = np.asarray(ids, dtype=np.int64)
            if a.size and (a.min() < 0 or a.max() >= vocab_size):
                raise ValueError(f"token id {int(a.max())} out of the vocabulary of {vocab_size:,}")
            chunks.append(a.astype(dtype))
            lengths.append(a.size)
        texts.clear()

    for record in _records(unit, src, lines):
        if record["bad"] is not None:
            bad.append([record["file"], record["line"], record["bad"], record["msg"]])
            continue
        texts.append(record["text"])
        crcs.append(zlib.crc32(record["text"].encode("utf-8")))
        if len(texts) >= ENCODE_BATCH:
            flush()
    flush()
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype)
    path, summary_path = part_paths(work, unit)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, tokens=tokens, lengths=np.asarray(lengths, np.uint64), crc32=np.asarray(crcs, np.uint32))
    os.replace(tmp, path)
    summary = {
        "unit": asdict(unit),
        "documents": len(lengths),
        "tokens": int(tokens.size),
        "bad": bad,
        "lines": lines[0],
    }
    tmp = summary_path.with_name(f".{summary_path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(summary))
    os.replace(tmp, summary_path)
    return summary


def load_part(work: Path, unit: Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens in the shards' dtype, document lengths uint64, CRC32s uint32) of a finished unit."""
    with np.load(part_paths(work, unit)[0]) as z:
        return z["tokens"], z["lengths"], z["crc32"]
