"""Corpus sanity on the driver: every source opened and a bounded prefix read before Ray, the workers or
a model start (called by ``pretrain/driver/prepare.py``); light imports, so a bad corpus is refused in seconds.

:func:`check_sources` resolves every source of ``data.sources`` and ``data.val_sources`` and reads its
prefix: at most ``PREFIX_BYTES`` bytes and ``PREFIX_RECORDS`` records over its first ``PREFIX_FILES``
files (txt/jsonl, with the same line parser as training), or its first ``PREFIX_RECORDS`` rows through
``datasets`` streaming (parquet, hub; of parquet, every file's footer too: its rows and columns). A source is
refused with one line, a :class:`ConfigError` that
names its key and path (and ``file:line`` where it helps), when it

* matches no file, or cannot be opened or streamed;
* is empty (no bytes, or only blank lines; a parquet file of no rows), or a parquet file lacks the text column;
* is not text: compressed, UTF-16 or binary data, judged on the first ``SNIFF_BYTES`` of each file;
* has no usable record in the prefix (for JSON records the line says which fields they do have);
* is a token-shard directory whose manifest is unreadable or from a newer format, or whose files are missing,
  truncated or corrupted (sizes and sampled sha256 against the manifest), or whose tokenizer is not the run's
  (:mod:`pretrain.data.shards.compat`).

Under ``data.bad_records: fail`` txt/jsonl sources are read on, up to ``SCAN_BYTES`` (so a small corpus
whole), and the first bad record raises :class:`BadRecordError` (``file:line: reason``) as training would;
a bad record beyond that is reported where it is read (still exit 2 in the CLI).

:func:`check_corpus` runs these checks, then :func:`pretrain.data.split_plan.plan_split`.
"""

from __future__ import annotations

import codecs
import itertools
import json
import re

from pretrain.config import ConfigError, DataConfig, SourceConfig
from pretrain.config.errors import clip, quote
from pretrain.data.bad_records import REASONS, BadRecordError, BadRecords, refuse_skipped
from pretrain.data.sources import ResolvedSource, parse_line, prefix_lines, resolve_source
from pretrain.data.split_plan import SCAN_BYTES, SplitPlan, check_validation_sources, plan_split

PREFIX_BYTES = 1 << 20
PREFIX_RECORDS = 1000
PREFIX_FILES = 256
SNIFF_BYTES = 64 << 10

_MAGIC = {
    b"\x1f\x8b": "gzip-compressed data",
    b"\x28\xb5\x2f\xfd": "zstd-compressed data",
    b"BZh": "bzip2-compressed data",
    b"\xfd7zXZ\x00": "xz-compressed data",
    b"PK\x03\x04": "a zip archive",
    b"PAR1": "a parquet file",
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


def _check_lines(rs: ResolvedSource, policy: str, parquet_fix: str = "set format: parquet") -> str:
    """The problem of a txt/jsonl source's prefix ('' for none); ``parquet_fix`` tells how to read a parquet file."""
    files = rs.files[:PREFIX_FILES]
    size = 0
    for file in files:
        with open(file, "rb") as f:
            head = f.read(SNIFF_BYTES)
        size += len(head)
        why = why_not_text(head)
        if why:
            return f"not text: {file}: {why}" + (f" ({parquet_fix})" if head.startswith(b"PAR1") else "")
    if size == 0:
        more = f" (the first {len(files)} of {len(rs.files)} files)" if len(rs.files) > len(files) else ""
        return f"empty: {len(files)} file(s) of 0 bytes{more}"
    tally = _Tally(policy, rs.name)
    strict = policy == "fail"  # read on (up to SCAN_BYTES): a bad record is refused here, not in a worker
    for line in prefix_lines(rs.files if strict else files, SCAN_BYTES if strict else PREFIX_BYTES):
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

            for file in rs.files:  # every file's footer (no row is read): a bad one is refused here, not mid-run
                try:
                    parquet = pq.ParquetFile(file)
                except Exception as e:  # noqa: BLE001 - not parquet, truncated, unreadable: the file named
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    return f"cannot read {file}: {clip(first)}"
                if parquet.metadata.num_rows == 0:  # datasets cannot stream a file of no rows
                    return f"empty: {file} has no rows (datasets cannot stream an empty parquet file)"
                columns = parquet.schema_arrow.names
                if rs.text_field not in columns:
                    return (
                        f"{file} has no column {quote(rs.text_field)} (columns: {clip(', '.join(columns))}); set "
                        "text_field"
                    )
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


def check_source(src: SourceConfig, key: str, cfg: DataConfig, format_option: str = "") -> ResolvedSource:
    """Resolve one source and check its prefix; raises :class:`ConfigError` (or ``BadRecordError``).
    ``format_option``: the command's option that names a format (``--format``), where it is not the config's."""
    rs = resolve_source(src, cfg.cache_dir, key, format_option=format_option)
    if rs.format == "shards":  # the manifest and its files (sizes, sampled sha256): ShardError names the file
        refuse_skipped(rs.shard_set().manifest.bad_records, cfg.bad_records, f"{key} ({clip(src.path)})")
        return rs
    try:
        if rs.format in ("text", "json"):
            fix = f"give {format_option} parquet" if format_option else f"set {key}.format: parquet"
            problem = _check_lines(rs, cfg.bad_records, fix)
        else:
            problem = _check_rows(rs, cfg.bad_records)
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


def check_corpus(cfg: DataConfig, *, seq_len: int, seed: int, val_sequences: int, open_hub: bool = True) -> SplitPlan:
    """The driver's corpus check: :func:`check_sources`, :func:`check_validation_sources`, then
    :func:`plan_split` (which open no hub dataset: their documents are taken as they are)."""
    check_sources(cfg, open_hub)
    check_validation_sources(cfg, seq_len=seq_len, val_sequences=val_sequences)
    return plan_split(cfg, seq_len=seq_len, seed=seed, val_sequences=val_sequences)
