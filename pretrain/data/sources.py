"""Data sources: resolving a :class:`SourceConfig` to files, reading records tolerantly (bad records as data:
:mod:`pretrain.data.bad_records`).

Every source is read through real ``datasets`` streaming datasets:

* ``text``/``json`` files: our own tolerant line reader wrapped in
  ``datasets.IterableDataset.from_generator`` (one shard per file). Files are read in binary and each
  line decoded on its own, so undecodable bytes, invalid JSON, a missing or non-string text field and
  empty text become *bad records* with an exact ``file:line``. Blank lines of ``.txt`` files are
  skipped silently (they separate nothing: every non-empty line is a document).
* ``parquet`` files: ``datasets.load_dataset("parquet", data_files=FILE, streaming=True)``, one per
  file, so a bad row is reported as ``file:row N`` (0-based row index within the file).
* ``hub``: ``datasets.load_dataset(name, split=split, streaming=True, revision=revision)`` (needs network access);
  a path ``org/name@revision`` pins a revision (a commit, tag or branch), ``org/name`` streams the default branch.
* ``shards``: a directory written by ``./launch.sh tokenize`` (its ``manifest.json`` names the token-shard format;
  one of another kind is a file like any other): its documents are read as tokens by memory map
  (:mod:`pretrain.data.shards.reader`), never tokenized again.

Each record reaches the caller as a dict ``{"text": str | None, "bad": reason | None, "msg": str,
"file": str, "line": int | str}``; bad records are *data*, not side effects of the reader, so
re-reading (e.g. skipping ahead when a ``datasets`` state is restored) never double-counts them.

**Pieces.** With ``data.piece_chars`` > 0 (set by the driver for a corpus of too few documents, e.g. one
huge line: see :mod:`pretrain.data.sanity`), every txt/jsonl document longer than that is cut into pieces
of at most ``piece_chars`` characters (:func:`cut_pieces`), each a document of its own; the reader yields
them as separate rows, so a ``datasets`` state stays exact inside a document.

``datasets`` is imported only when a source is opened: resolving sources and reading lines (the driver's
corpus checks) stays light.
"""

from __future__ import annotations

import atexit
import glob as globlib
import json
import os
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pretrain.config import ConfigError, DataConfig, SourceConfig
from pretrain.config.errors import clip, not_a, quote
from pretrain.data.bad_records import bad_record, check_text
from pretrain.data.demo_corpus import build_demo_corpus
from pretrain.data.shards.format import MANIFEST as SHARD_MANIFEST
from pretrain.data.shards.format import is_shard_dir

if TYPE_CHECKING:
    import datasets


_EXTENSIONS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_COMPRESSED = {".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".zip"}
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?(@[\w.\-/]+)?")


# ----------------------------------------------------------------------------------------------
# Line reader (txt / jsonl)
# ----------------------------------------------------------------------------------------------


def parse_line(raw: bytes, lineno: int, fmt: str, text_field: str, file: str) -> dict | None:
    """One line of a txt (``fmt`` text) or jsonl file as a record; None for a blank txt line (no record)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return bad_record("bad_utf8", file, lineno, f"byte 0x{raw[e.start]:02x} at column {e.start + 1}")
    if lineno == 1 and line.startswith("\ufeff"):
        line = line[1:]
    line = line.rstrip("\r\n")
    if fmt == "text":
        return {"text": line, "bad": None, "msg": "", "file": file, "line": lineno} if line.strip() else None
    if not line.strip():
        return bad_record("empty", file, lineno, "blank line")
    try:
        obj = json.loads(line)
    except ValueError as e:
        return bad_record("invalid_json", file, lineno, clip(getattr(e, "msg", e)))
    except RecursionError:
        return bad_record("invalid_json", file, lineno, "nested too deeply")
    if isinstance(obj, dict):
        return check_text(obj.get(text_field), text_field in obj, text_field, file, lineno)
    return bad_record("missing_field", file, lineno, f"{quote(text_field)}; record is a {type(obj).__name__}")


def cut_pieces(text: str, size: int) -> Iterator[str]:
    """``text`` cut into pieces of at most ``size`` characters, each at the last space of its window when
    that lies in the window's second half (the space is dropped), else exactly at ``size``; blank pieces
    are dropped. A text of at most ``size`` characters is one piece. (A generator: a huge document is
    never held twice.)"""
    start, n = 0, len(text)
    while n - start > size:
        end = start + size
        cut = text.rfind(" ", start + size // 2, end)
        stop, nxt = (end, end) if cut < 0 else (cut, cut + 1)
        if text[start:stop].strip():
            yield text[start:stop]
        start = nxt
    if text[start:].strip():
        yield text[start:]


def read_lines(files: list[str], fmt: str, text_field: str, piece_chars: int = 0) -> Iterator[dict]:
    """Tolerant reader of txt (one document per non-empty line) and jsonl files (``from_generator``);
    with ``piece_chars`` > 0, longer documents come as their :func:`cut_pieces`."""
    for file in files:
        with open(file, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                record = parse_line(raw, lineno, fmt, text_field, file)
                if record is None:
                    continue
                if piece_chars and record["bad"] is None and len(record["text"]) > piece_chars:
                    for piece in cut_pieces(record["text"], piece_chars):
                        yield {**record, "text": piece}
                else:
                    yield record


@dataclass
class PrefixLine:
    file: str
    lineno: int
    raw: bytes
    complete: bool  # False: the budget cut the line


def prefix_lines(files: list[str], budget: int) -> Iterator[PrefixLine]:
    """The first lines of ``files`` within ``budget`` bytes, never reading a line past the budget."""
    for file in files:
        with open(file, "rb") as f:
            lineno = 0
            while budget > 0:
                raw = f.readline(budget)
                if not raw:
                    break
                lineno += 1
                budget -= len(raw)
                yield PrefixLine(file, lineno, raw, raw.endswith(b"\n") or not f.peek(1))
        if budget <= 0:
            return


# ----------------------------------------------------------------------------------------------
# Source resolution
# ----------------------------------------------------------------------------------------------


@dataclass
class ResolvedSource:
    """A source resolved to concrete files (or a hub name) and a single format."""

    name: str
    format: str  # text | json | parquet | hub | shards
    files: list[str] = field(default_factory=list)
    text_field: str = "text"
    weight: float = 1.0
    hub_path: str = ""
    """A hub dataset's name (or URL), without its revision."""
    revision: str = ""
    """The revision a hub path pins (``org/name@revision``); '' for the default branch."""
    split: str = "train"
    piece_chars: int = 0
    """txt/jsonl documents longer than this are read as their pieces (:func:`cut_pieces`); 0 never."""
    _shards: Any = field(default=None, repr=False, compare=False)

    @property
    def num_parts(self) -> int:
        return len(self.files) if self.format == "parquet" else 1

    def shard_set(self):
        """The memory-mapped :class:`pretrain.data.shards.reader.ShardSet` of a ``shards`` source (opened, and its
        files checked against the manifest, on first use)."""
        from pretrain.data.shards.reader import ShardSet

        if self._shards is None:
            self._shards = ShardSet(self.files[0])
        return self._shards

    def open_part(self, part: int) -> datasets.IterableDataset:
        """A fresh ``datasets`` streaming dataset for one part (the whole source, or one parquet file).

        Every virtual stream (and every pass) iterates its own dataset object: an IterableDataset keeps
        the state of its latest iteration. (Deep-copying a template is not safe: the copy drags the
        builder and shared caches along.)"""
        import datasets

        if self.format in ("text", "json"):
            kwargs: dict[str, Any] = {"files": list(self.files), "fmt": self.format, "text_field": self.text_field}
            if self.piece_chars:
                kwargs["piece_chars"] = self.piece_chars
            return datasets.IterableDataset.from_generator(read_lines, gen_kwargs=kwargs)
        if self.format == "parquet":
            ds = datasets.load_dataset("parquet", data_files=[self.files[part]], split="train", streaming=True)
            if ds.column_names is not None and self.text_field not in ds.column_names:
                raise ValueError(
                    f"{self.files[part]}: no column {quote(self.text_field)} "
                    f"(columns: {clip(', '.join(ds.column_names))}); set text_field in source {quote(self.name)}"
                )
            return ds.select_columns([self.text_field]) if ds.column_names else ds
        try:
            return datasets.load_dataset(
                self.hub_path, split=self.split, streaming=True, revision=self.revision or None
            )
        except Exception as e:  # noqa: BLE001 - offline, unknown name...: one clear line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"data source {quote(self.name)}: could not stream {quote(self.hub_path)} "
                f"(not a local path; hub load failed: {clip(first)})"
            ) from e

    def convert(self, row: dict, part: int, index: int) -> dict:
        """Normalize a raw row of part ``part`` (``index``: row number within it) to a record dict."""
        if self.format in ("text", "json"):
            return row
        file = self.files[part] if self.format == "parquet" else f"{self.hub_path}[{self.split}]"
        return check_text(row.get(self.text_field), self.text_field in row, self.text_field, file, f"row {index}")


def _looks_like_hub(path: str) -> bool:
    if "://" in path:
        return True
    return bool(_HUB_NAME.fullmatch(path)) and Path(hub_revision(path)[0]).suffix.lower() not in _EXTENSIONS


def hub_revision(path: str) -> tuple[str, str]:
    """A hub path as (name, revision): ``org/name@rev`` -> ``("org/name", "rev")``; no ``@`` (or a URL, whose ``@``
    is not a revision) -> ``(path, "")``."""
    if "://" in path:
        return path, ""
    name, _, revision = path.partition("@")
    return name, revision


def _hub_source(path: str, base: dict[str, Any]) -> ResolvedSource:
    name, revision = hub_revision(path)
    return ResolvedSource(format="hub", hub_path=name, revision=revision, **base)


def _directory_files(root: Path) -> list[Path]:
    """The files below ``root``, sorted; not hidden ones, nor those of a token-shard directory inside it (the
    output of ``./launch.sh tokenize``: its manifest and tokenizer are JSON, not the corpus)."""
    shard_dirs = {m.parent for m in root.rglob(SHARD_MANIFEST) if is_shard_dir(m.parent)}
    return sorted(
        f
        for f in root.rglob("*")
        if f.is_file()
        and not any(x.startswith(".") for x in f.relative_to(root).parts)
        and not any(d in shard_dirs for d in f.parents)
    )


def resolve_source(
    src: SourceConfig, cache_dir: str | Path, key: str = "", piece_chars: int = 0, *, format_option: str = ""
) -> ResolvedSource:
    """Turn a source config into files and one format (``path: demo`` is the built-in corpus).

    A source that resolves to nothing raises :class:`ConfigError` naming ``key`` (e.g. ``data.sources[0]``)
    or, without a key, the source's name. A file whose extension tells no format is told to set the source's
    ``format``, or ``format_option`` when given (a command's option, e.g. ``--format``)."""
    name = src.name or src.path
    label = f"{key}.path" if key else f"data source {quote(name)}"
    base: dict[str, Any] = dict(
        name=name, text_field=src.text_field, weight=src.weight, split=src.split, piece_chars=piece_chars
    )
    if src.format == "hub":
        return _hub_source(src.path, base)
    if src.path == "demo":
        try:
            files = [build_demo_corpus(Path(cache_dir))]
        except OSError as e:
            raise ConfigError(
                f"data.cache_dir: cannot write the demo corpus into {cache_dir} ({e.strerror or e})"
            ) from None
        return ResolvedSource(
            format="text" if src.format == "auto" else src.format, files=[str(f) for f in files], **base
        )
    p, shown = Path(src.path).expanduser(), clip(src.path)
    if os.path.isdir(p) and is_shard_dir(p):  # written by ./launch.sh tokenize
        return ResolvedSource(format="shards", files=[str(p)], **base)
    if os.path.isdir(p):  # (os.path: Path.is_dir raises on a name too long)
        files = _directory_files(p)
        if src.format == "auto":
            packed = [
                f for f in files if f.suffix.lower() in _COMPRESSED and Path(f.stem).suffix.lower() in _EXTENSIONS
            ]
            if packed:
                raise ConfigError(
                    f"{label}: {clip(str(packed[0]))} is compressed ({packed[0].suffix}), and compressed files are "
                    f"not read: decompress the {len(packed)} compressed file(s) of {shown}, or move them out of it"
                )
            files = [f for f in files if f.suffix.lower() in _EXTENSIONS]
    elif os.path.isfile(p):
        files = [p]
    elif any(c in src.path for c in "*?["):
        files = sorted(Path(f) for f in globlib.glob(str(p), recursive=True) if Path(f).is_file())
    elif not_a(p):  # a FIFO, a socket, a device: what it is (never opened: reading a FIFO would block)
        raise ConfigError(f"{label}: {shown} {not_a(p)}")
    elif _looks_like_hub(src.path):
        return _hub_source(src.path, base)
    else:
        raise ConfigError(f"{label}: {shown} does not exist")
    if not files:
        where = (
            f"no data files ({', '.join(sorted(_EXTENSIONS))}) in the directory {shown}; for files of other "
            f"names, set format (text, json, parquet): every file of the directory is then read, or give a glob"
            if os.path.isdir(p)
            else f"no file matches {shown}"
        )
        raise ConfigError(f"{label}: {where}")
    fmt: str = src.format
    if fmt == "auto":
        kinds = {_EXTENSIONS.get(f.suffix.lower()) for f in files}
        if None in kinds:
            bad = next(f for f in files if f.suffix.lower() not in _EXTENSIONS)
            zipped = next((f for f in files if f.suffix.lower() in _COMPRESSED), None)
            if zipped is not None:  # a format would not help: the reader does not decompress
                raise ConfigError(
                    f"{label}: {clip(str(zipped))} is compressed ({zipped.suffix}), and compressed files are not "
                    "read: decompress it"
                )
            where = key or f"data source {quote(name)}"
            where, remedy = (where, f"give {format_option}") if format_option else (f"{where}.format", "set format")
            raise ConfigError(
                f"{where}: cannot tell the format of {bad} from its extension; {remedy} (text, json, parquet)"
            )
        if len(kinds) > 1:
            raise ConfigError(f"{label}: mixed formats {sorted(cast(set[str], kinds))}; use one source per format")
        fmt = cast(str, kinds.pop())  # None was ruled out above
    return ResolvedSource(format=fmt, files=[str(f) for f in files], **base)


def resolve_sources(
    sources: list[SourceConfig], cache_dir: str | Path, key: str = "", piece_chars: int = 0
) -> list[ResolvedSource]:
    """Every source resolved; errors name ``key[i]`` when ``key`` (e.g. ``data.sources``) is given."""
    return [resolve_source(s, cache_dir, f"{key}[{i}]" if key else "", piece_chars) for i, s in enumerate(sources)]


def training_sources(cfg: DataConfig) -> list[ResolvedSource]:
    """``data.sources`` resolved as every reader of training documents sees them (pieces included)."""
    return resolve_sources(cfg.sources, cfg.cache_dir, "data.sources", cfg.piece_chars)


def validation_sources(cfg: DataConfig) -> list[ResolvedSource]:
    """``data.val_sources`` resolved (never cut into pieces)."""
    return resolve_sources(cfg.val_sources, cfg.cache_dir, "data.val_sources")


# ----------------------------------------------------------------------------------------------
# Reading one source with an exact, JSON-serializable position
# ----------------------------------------------------------------------------------------------


def open_reader(source: ResolvedSource, state: dict | None = None):
    """The reader of one source from ``state``: a :class:`SourceReader`, or for token shards a
    :class:`pretrain.data.shards.reader.ShardReader`."""
    if source.format == "shards":
        from pretrain.data.shards.reader import ShardReader

        return ShardReader(source.shard_set(), source.name, state)
    return SourceReader(source, state)


_LIVE_READERS: weakref.WeakSet[SourceReader] = weakref.WeakSet()


@atexit.register
def _close_readers() -> None:
    """Close suspended dataset iterators before interpreter teardown (the parquet reader of
    ``datasets`` otherwise prints 'Exception ignored' noise when collected with modules gone)."""
    for reader in list(_LIVE_READERS):
        reader.close()


class SourceReader:
    """Iterates the records of one source; ``state_dict()`` is exact after any record.

    State: ``{"part": k, "rows": rows read in part k, "dataset": the datasets state_dict or None}``.
    """

    def __init__(self, source: ResolvedSource, state: dict | None = None):
        self.source = source
        state = state or {}
        self.part = int(state.get("part", 0))
        self.rows = int(state.get("rows", 0))
        self._ds_state = state.get("dataset")
        self._ds: datasets.IterableDataset | None = None
        self._it: Iterator | None = None
        _LIVE_READERS.add(self)

    def close(self) -> None:
        it, self._it = self._it, None
        if self._ds is not None:
            self._ds_state = self._ds.state_dict()
            self._ds = None
        if it is not None and hasattr(it, "close"):
            try:
                it.close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass

    def state_dict(self) -> dict:
        ds_state = self._ds.state_dict() if self._ds is not None else self._ds_state
        return {"part": self.part, "rows": self.rows, "dataset": ds_state}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while True:
            if self.part >= self.source.num_parts:
                raise StopIteration
            if self._it is None:
                self._ds = self.source.open_part(self.part)
                if self._ds_state is not None:
                    self._ds.load_state_dict(self._ds_state)
                self._it = iter(self._ds)
            try:
                row = next(self._it)
            except StopIteration:
                self.part, self.rows = self.part + 1, 0
                self._ds = self._it = self._ds_state = None
                continue
            self.rows += 1
            record = self.source.convert(row, self.part, self.rows - 1)
            if record["bad"] is not None:
                record = {**record, "source": self.source.name}
            return record
