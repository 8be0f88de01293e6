"""Corpus sanity on the driver: every source opened and a bounded prefix read before Ray, the workers or
a model start (called by ``pretrain/driver/prepare.py``); light imports, so a bad corpus is refused in seconds.

:func:`check_sources` resolves every source of ``data.sources`` and ``data.val_sources`` and reads its
prefix: at most ``PREFIX_BYTES`` bytes and ``PREFIX_RECORDS`` records over its first ``PREFIX_FILES``
files (txt/jsonl, with the same line parser as training), or its first ``PREFIX_RECORDS`` rows through
``datasets`` streaming (parquet, hub). A source is refused with one line, a :class:`ConfigError` that
names its key and path (and ``file:line`` where it helps), when it

* matches no file, or cannot be opened or streamed;
* is empty (no bytes, or only blank lines);
* is not text: compressed, UTF-16 or binary data, judged on the first ``SNIFF_BYTES`` of each file;
* has no usable record in the prefix (for JSON records the line says which fields they do have);
* is a token-shard directory whose manifest is unreadable or from a newer format, or whose files are missing,
  truncated or corrupted (sizes and sampled sha256 against the manifest), or whose tokenizer is not the run's
  (:mod:`pretrain.data.shards.compat`).

Under ``data.bad_records: fail`` txt/jsonl sources are read on, up to ``SCAN_BYTES`` (so a small corpus
whole), and the first bad record raises :class:`BadRecordError` (``file:line: reason``) as training would;
a bad record beyond that is reported where it is read (still exit 2 in the CLI).

:func:`plan_split` then decides how the training documents are split. Documents are dealt to the
virtual streams by index and the validation holdout takes whole documents, so a corpus of too few
documents (say one 20 MB line) cannot work: some stream gets no document, or the holdout gets no text.
The plan reads the txt/jsonl training sources (at most ``SCAN_BYTES``) until it has seen enough
documents for both -- almost at once for any ordinary corpus, which is then left exactly as it is. Only
when the whole corpus was read and the document-level split *provably* fails (fewer training documents
in a pass than ``data.num_streams``, or validation documents that cannot fill one sequence even at two
tokens per byte) does it set ``data.piece_chars``: documents are cut into pieces of about one sequence,
each dealt and held out on its own -- a sequence-level split. When even that cannot work, the corpus is
refused as too small. The decision is recorded in the resolved config, so every worker (and a resume)
splits the same way.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pretrain.config import ConfigError, DataConfig, SourceConfig
from pretrain.config.errors import clip
from pretrain.data.bad_records import REASONS, BadRecordError, BadRecords
from pretrain.data.shards.format import load_manifest
from pretrain.data.sources import ResolvedSource, cut_pieces, parse_line, resolve_source
from pretrain.data.stream import Mixture, is_holdout

PREFIX_BYTES = 1 << 20
PREFIX_RECORDS = 1000
PREFIX_FILES = 256
SNIFF_BYTES = 64 << 10
SCAN_BYTES = 64 << 20
SCAN_DRAWS = 10_000_000
CHARS_PER_TOKEN = 4  # a piece of about one sequence: CHARS_PER_TOKEN * seq_len characters

_MAGIC = {
    b"\x1f\x8b": "gzip-compressed data",
    b"\x28\xb5\x2f\xfd": "zstd-compressed data",
    b"BZh": "bzip2-compressed data",
    b"\xfd7zXZ\x00": "xz-compressed data",
    b"PK\x03\x04": "a zip archive",
    b"PAR1": "a parquet file (set format: parquet)",
    b"\x7fELF": "an executable",
}
_NOT_TEXT = re.compile("[\x00-\x08\x0e-\x1f\x7f\ufffd]")


# ----------------------------------------------------------------------------------------------
# Prefix checks
# ----------------------------------------------------------------------------------------------


def why_not_text(head: bytes) -> str:
    """Why the first bytes of a file are not UTF-8 text; '' when they look like text."""
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return f"it looks like {what}"
    if head[:2] in (b"\xff\xfe", b"\xfe\xff") or head.count(0) > len(head) // 4:
        return "it looks like UTF-16 text (the reader expects UTF-8)"
    text = head.decode("utf-8", errors="replace")
    bad = len(_NOT_TEXT.findall(text))
    if text and bad > 0.3 * len(text):
        return f"{100 * bad // len(text)}% of its first {len(head):,} bytes are not UTF-8 text (binary data?)"
    return ""


@dataclass
class _Line:
    file: str
    lineno: int
    raw: bytes
    complete: bool  # False: the budget cut the line


def _prefix_lines(files: list[str], budget: int) -> Iterator[_Line]:
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
                yield _Line(file, lineno, raw, raw.endswith(b"\n") or not f.peek(1))
        if budget <= 0:
            return


class _Tally:
    """What a prefix held: good records, bad ones by reason (first example each), JSON fields seen."""

    def __init__(self, policy: str, name: str):
        self.bad = BadRecords(policy)  # under ``fail`` the first bad record raises BadRecordError
        self.name = name
        self.good = 0
        self.records = 0
        self.example = ""
        self.fields: dict[str, None] = {}

    def add(self, record: dict, obj=None) -> None:
        self.records += 1
        if record["bad"] is None:
            self.good += 1
            return
        self.bad.add({**record, "source": self.name})
        if not self.example:
            self.example = f"{record['file']}:{record['line']}: {record['msg']}"
        if isinstance(obj, dict):
            self.fields.update(dict.fromkeys(map(str, itertools.islice(obj, 20))))

    def problem(self, text_field: str) -> str:
        if self.good:
            return ""
        reasons = ", ".join(f"{n} {REASONS.get(r, r)}" for r, n in sorted(self.bad.by_reason.items()))
        line = f"no usable record in the first {self.records} ({reasons}; e.g. {self.example})"
        if "missing_field" in self.bad.by_reason and self.fields:
            fields = clip(", ".join(clip(f, 60) for f in itertools.islice(self.fields, 12)))
            line += f"; the records have the fields {fields}: set text_field"
        return line


def _check_lines(rs: ResolvedSource, policy: str) -> str:
    """The problem of a txt/jsonl source's prefix ('' for none)."""
    files = rs.files[:PREFIX_FILES]
    size = 0
    for file in files:
        with open(file, "rb") as f:
            head = f.read(SNIFF_BYTES)
        size += len(head)
        why = why_not_text(head)
        if why:
            return f"not text: {file}: {why}"
    if size == 0:
        more = f" (the first {len(files)} of {len(rs.files)} files)" if len(rs.files) > len(files) else ""
        return f"empty: {len(files)} file(s) of 0 bytes{more}"
    tally = _Tally(policy, rs.name)
    strict = policy == "fail"  # read on (up to SCAN_BYTES): a bad record is refused here, not in a worker
    for line in _prefix_lines(rs.files if strict else files, SCAN_BYTES if strict else PREFIX_BYTES):
        if not line.complete:
            if rs.format == "text" and tally.good == 0:  # a document longer than the prefix: text so far?
                try:
                    if codecs.getincrementaldecoder("utf-8")().decode(line.raw).strip():
                        tally.good += 1
                except UnicodeDecodeError:
                    pass
            if tally.records == 0 and tally.good == 0:
                return ""  # one JSON line longer than the prefix: cannot tell here
            break
        record = parse_line(line.raw, line.lineno, rs.format, rs.text_field, line.file)
        if record is None:
            continue
        obj = None
        if record["bad"] == "missing_field":
            try:
                obj = json.loads(line.raw)
            except (ValueError, RecursionError):
                pass
        tally.add(record, obj)
        if tally.records >= PREFIX_RECORDS and not strict:
            break
    if tally.records == 0 and tally.good == 0:
        return "empty: only blank lines"
    return tally.problem(rs.text_field)


def _check_rows(rs: ResolvedSource, policy: str) -> str:
    """The problem of a parquet/hub source's first rows ('' for none), read through ``datasets`` streaming."""
    tally = _Tally(policy, rs.name)
    try:
        if rs.format == "parquet":
            import pyarrow.parquet as pq

            for file in rs.files[:PREFIX_FILES]:  # datasets cannot stream a file of no rows
                if pq.ParquetFile(file).metadata.num_rows == 0:
                    return f"empty: {file} has no rows (datasets cannot stream an empty parquet file)"
        for part in range(min(rs.num_parts, PREFIX_FILES)):
            for index, row in enumerate(itertools.islice(rs.open_part(part), PREFIX_RECORDS - tally.records)):
                tally.add(rs.convert(row, part, index), row)
            if tally.records >= PREFIX_RECORDS or tally.good:
                break
    except BadRecordError:
        raise
    except Exception as e:  # noqa: BLE001 - unreadable parquet, offline hub, ...: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"cannot read it: {clip(first)}"
    if tally.records == 0:
        return "empty: no rows"
    return tally.problem(rs.text_field)


def check_source(src: SourceConfig, key: str, cfg: DataConfig) -> ResolvedSource:
    """Resolve one source and check its prefix; raises :class:`ConfigError` (or ``BadRecordError``)."""
    rs = resolve_source(src, cfg.cache_dir, key)
    if rs.format == "shards":  # the manifest and its files (sizes, sampled sha256): ShardError names the file
        rs.shard_set()
        return rs
    try:
        check = _check_lines if rs.format in ("text", "json") else _check_rows
        problem = check(rs, cfg.bad_records)
    except OSError as e:
        problem = f"cannot read it: {e.strerror or e}: {e.filename or ''}".rstrip(": ")
    if problem:
        raise ConfigError(f"{key} ({clip(src.path)}): {problem}")
    return rs


def _keyed(cfg: DataConfig) -> list[tuple[str, SourceConfig]]:
    """(config key, source) of every training and validation source."""
    return [
        (f"{key}[{i}]", src)
        for key, sources in (("data.sources", cfg.sources), ("data.val_sources", cfg.val_sources))
        for i, src in enumerate(sources)
    ]


def hub_sources(cfg: DataConfig) -> list[ResolvedSource]:
    """The training and validation sources that are hub datasets (resolving a source opens nothing remote)."""
    resolved = (resolve_source(src, cfg.cache_dir, key) for key, src in _keyed(cfg) if src.path != "demo")
    return [rs for rs in resolved if rs.format == "hub"]


def check_sources(cfg: DataConfig, open_hub: bool = True) -> None:
    """Every training and validation source resolved (all of them first: the quick refusals), then each
    one's prefix checked; ``open_hub=False`` leaves hub datasets unopened (no network)."""
    keyed = _keyed(cfg)
    for key, src in keyed:
        if src.path != "demo":
            resolve_source(src, cfg.cache_dir, key)
    for key, src in keyed:
        if open_hub or src.path == "demo" or resolve_source(src, cfg.cache_dir, key).format != "hub":
            check_source(src, key, cfg)
    from pretrain.data.shards.compat import shards_tokenizer

    shards_tokenizer(cfg)  # token shards: one tokenizer, and data.tokenizer (if set) is it


# ----------------------------------------------------------------------------------------------
# Document- or sequence-level split
# ----------------------------------------------------------------------------------------------


@dataclass
class SplitPlan:
    piece_chars: int
    """What ``data.piece_chars`` becomes (0: documents as they are)."""
    message: str = ""
    """One line for the user when the split falls back to pieces ('' otherwise)."""


class _Inconclusive(Exception):
    """The scan could not read the whole corpus within its budget."""


class _ReplayMixture(Mixture):
    """The training mixture over scanned records (exactly the draws the training streams make)."""

    def __init__(self, sources: list[ResolvedSource], seed: int, records: list[list[dict]]):
        self._records = records
        super().__init__(sources, seed)

    def _open(self, i: int, state: dict | None = None):
        return iter(self._records[i])


class _Need:
    """What the document-level split needs, counted incrementally: ``S`` training documents (a lower bound of
    a pass: every source is read whole at least once per pass) and held-out text for one sequence."""

    def __init__(self, S: int, holdout: float, val_needed: bool, seq_len: int):
        self.S, self.holdout, self.val_needed, self.seq_len = S, holdout, val_needed, seq_len
        self.train = 0
        self.val: set[str] = set()
        self.val_tokens = 0  # an upper bound of what the unique held-out documents tokenize to

    def add(self, text: str) -> bool:
        """Count a good document; True once the split may work."""
        if not is_holdout(text, self.holdout):
            self.train += 1
        elif text not in self.val:
            self.val.add(text)
            self.val_tokens += _max_tokens(text)
        return self.train >= self.S and self.val_ok

    @property
    def val_ok(self) -> bool:
        return not self.val_needed or self.val_tokens >= self.seq_len


def _max_tokens(text: str) -> int:
    """More tokens than any tokenizer makes of ``text`` (two per byte, a prefix token) plus its separator."""
    return 2 * (len(text.encode("utf-8")) + 1) + 1


def _scan(sources: list[ResolvedSource], need: _Need) -> list[list[dict]] | None:
    """Records of every source (txt/jsonl) in order, or None as soon as ``need`` is met."""
    budget, records = SCAN_BYTES, []
    for rs in sources:
        mine: list[dict] = []
        records.append(mine)
        for line in _prefix_lines(rs.files, budget):
            if not line.complete:
                raise _Inconclusive
            budget -= len(line.raw)
            record = parse_line(line.raw, line.lineno, rs.format, rs.text_field, line.file)
            if record is not None:
                mine.append(record)
                if record["bad"] is None and need.add(record["text"]):
                    return None
        if budget <= 0:
            raise _Inconclusive
    return records


def _pass_count(sources, records, seed: int, holdout: float, at_least: int) -> int:
    """Training documents of one pass of the mixture (counting stops at ``at_least``)."""
    mixture = _ReplayMixture(sources, seed, records)
    n = 0
    for draws, row in enumerate(mixture):
        if row["bad"] is None and not is_holdout(row["text"], holdout):
            n += 1
            if n >= at_least:
                break
        if draws >= SCAN_DRAWS:
            raise _Inconclusive
    return n


def _pieces(records: list[list[dict]], size: int) -> list[list[dict]]:
    return [
        [{**r, "text": p} for r in recs for p in (cut_pieces(r["text"], size) if r["bad"] is None else [None])]
        for recs in records
    ]


def plan_split(cfg: DataConfig, *, seq_len: int, seed: int, val_sequences: int) -> SplitPlan:
    """Document-level split, or pieces when documents are provably too few (see the module docstring)."""
    if cfg.piece_chars:
        return SplitPlan(cfg.piece_chars)
    sources = [resolve_source(s, cfg.cache_dir, f"data.sources[{i}]") for i, s in enumerate(cfg.sources)]
    S = cfg.num_streams
    if all(rs.format == "shards" for rs in sources):  # their manifests count the documents; never cut into pieces
        docs = sum(load_manifest(Path(rs.files[0])).documents for rs in sources)
        if docs < S:
            raise ConfigError(
                f"data.sources: the token shards hold {docs} document{'s' if docs != 1 else ''}, fewer than the "
                f"data.num_streams={S} streams that each need one (shards are not cut into pieces): lower "
                "data.num_streams, or tokenize more text"
            )
    if any(rs.format not in ("text", "json") for rs in sources):
        return SplitPlan(0)  # parquet / hub / token shards: documents as they are
    holdout = 0.0 if cfg.val_sources else cfg.val_holdout
    val_needed = holdout > 0 and val_sequences > 0

    def need() -> _Need:
        return _Need(S, holdout, val_needed, seq_len)

    def tally(records: list[list[dict]]) -> _Need:
        n = need()
        for r in itertools.chain.from_iterable(records):
            if r["bad"] is None:
                n.add(r["text"])
        return n

    try:
        records = _scan(sources, need())
        if records is None:
            return SplitPlan(0)
        whole = tally(records)
        if whole.val_ok and _pass_count(sources, records, seed, holdout, S) >= S:
            return SplitPlan(0)
        size = max(32, CHARS_PER_TOKEN * seq_len)
        pieces = _pieces(records, size)
        train = _pass_count(sources, pieces, seed, holdout, S)
    except _Inconclusive:
        return SplitPlan(0)
    docs = sum(1 for r in itertools.chain.from_iterable(records) if r["bad"] is None)
    chars = sum(len(r["text"]) for r in itertools.chain.from_iterable(records) if r["bad"] is None)
    corpus = f"{docs} document{'s' if docs != 1 else ''} ({chars:,} characters)"
    streams = f"data.num_streams={S}"
    if train < S:
        raise ConfigError(
            f"data.sources: too little text to train on: {corpus} in all, not a document for each of the "
            f"{streams} streams even cut into pieces (add data or lower data.num_streams)"
        )
    if not tally(pieces).val_ok:
        raise ConfigError(
            f"data.val_holdout: {holdout:g} of {corpus} is less than one {seq_len}-token sequence even "
            f"cut into pieces (raise data.val_holdout, give data.val_sources, or set data.val_holdout=0)"
        )
    too_few = f"a document-level holdout ({holdout:g}) and {streams}" if val_needed else streams
    held = f"; {holdout:g} of them held out" if val_needed else ""
    return SplitPlan(
        size,
        f"data: {corpus} {'is' if docs == 1 else 'are'} too few for {too_few}: the holdout falls "
        f"back to a sequence-level split (documents cut into pieces of {size} characters, about one "
        f"{seq_len}-token sequence each{held})",
    )


def check_validation_sources(cfg: DataConfig, *, seq_len: int, val_sequences: int) -> None:
    """``data.val_sources`` (txt/jsonl) that provably cannot fill one validation sequence are refused."""
    if not cfg.val_sources or val_sequences <= 0:
        return
    sources = [resolve_source(s, cfg.cache_dir, f"data.val_sources[{i}]") for i, s in enumerate(cfg.val_sources)]
    if any(rs.format not in ("text", "json") for rs in sources):
        return
    try:
        records = _scan(sources, _Need(0, 1.0, True, seq_len))  # holdout 1.0: every document is validation
    except _Inconclusive:
        return
    if records is not None:
        texts = {r["text"] for r in itertools.chain.from_iterable(records) if r["bad"] is None}
        raise ConfigError(
            f"data.val_sources: too little text for validation: {len(texts)} distinct document(s), "
            f"{sum(map(len, texts)):,} characters in all, less than one {seq_len}-token sequence "
            f"(add validation data)"
        )


def check_corpus(cfg: DataConfig, *, seq_len: int, seed: int, val_sequences: int, open_hub: bool = True) -> SplitPlan:
    """The driver's corpus check: :func:`check_sources`, :func:`check_validation_sources`, then
    :func:`plan_split` (which open no hub dataset: their documents are taken as they are)."""
    check_sources(cfg, open_hub)
    check_validation_sources(cfg, seq_len=seq_len, val_sequences=val_sequences)
    return plan_split(cfg, seq_len=seq_len, seed=seed, val_sequences=val_sequences)
