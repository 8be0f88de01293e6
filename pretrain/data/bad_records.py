"""Bad records: what makes a record bad (:data:`REASONS`), the records a reader yields for them, and their
bookkeeping (counts per reason and source, the first examples as ``file:line: reason``), or the error that
``data.bad_records: fail`` raises."""

from __future__ import annotations

from typing import Any

from pretrain.config import ConfigError
from pretrain.config.errors import clip, quote


class BadRecordError(ConfigError):
    """A malformed record under ``bad_records: fail``; ``str(e)`` is one line ``path:line: reason``. A user
    error in the data: the CLI refuses it like a config error (one line, exit 2), also from a worker."""


REASONS = {
    "invalid_json": "invalid JSON",
    "missing_field": "missing text field",
    "not_string": "text field is not a string",
    "bad_utf8": "undecodable UTF-8 bytes",
    "empty": "empty text",
    "bad_unicode": "text is not valid Unicode",
}

_MAX_EXAMPLES = 20


class BadRecords:
    """Counts bad records per reason and keeps the first examples; ``fail`` raises instead."""

    def __init__(self, policy: str = "skip"):
        if policy not in ("skip", "fail"):
            raise ValueError(f"data.bad_records: expected skip or fail, got {policy!r}")
        self.policy = policy
        self.by_reason: dict[str, int] = {}
        self.by_source: dict[str, int] = {}
        self.examples: list[list] = []  # [file, line, message]
        self._seen: set[tuple] = set()

    def add(self, row: dict) -> None:
        msg = " ".join(str(row["msg"]).split())
        if self.policy == "fail":
            raise BadRecordError(f"{clip(row['file'])}:{row['line']}: {clip(msg)}")
        self.by_reason[row["bad"]] = self.by_reason.get(row["bad"], 0) + 1
        source = str(row.get("source", ""))
        self.by_source[source] = self.by_source.get(source, 0) + 1
        key = (row["file"], row["line"], msg)
        if len(self.examples) < _MAX_EXAMPLES and key not in self._seen:
            self._seen.add(key)
            self.examples.append(list(key))

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def state_dict(self) -> dict:
        return {
            "by_reason": dict(self.by_reason),
            "by_source": dict(self.by_source),
            "examples": [list(e) for e in self.examples],
        }

    def load_state_dict(self, state: dict) -> None:
        self.by_reason = {str(k): int(v) for k, v in state.get("by_reason", {}).items()}
        self.by_source = {str(k): int(v) for k, v in state.get("by_source", {}).items()}
        self.examples = [list(e) for e in state.get("examples", [])]
        self._seen = {tuple(e) for e in self.examples}


def summarize_bad_records(parts: list[BadRecords]) -> dict:
    """Merge counters into ``{"total", "by_reason", "by_source", "examples": ["file:line: reason"]}``."""
    by_reason: dict[str, int] = {}
    by_source: dict[str, int] = {}
    examples: list[tuple] = []
    for part in parts:
        for k, v in part.by_reason.items():
            by_reason[k] = by_reason.get(k, 0) + v
        for k, v in part.by_source.items():
            by_source[k] = by_source.get(k, 0) + v
        examples.extend(tuple(e) for e in part.examples)

    def order(e: tuple) -> tuple:  # by file, then line; rows (``row N``: parquet, hub datasets) by number
        line = e[1]
        if isinstance(line, int):
            return (str(e[0]), 0, line, "")
        row = str(line).removeprefix("row ")
        return (str(e[0]), 1, int(row), "") if row.isdigit() else (str(e[0]), 2, 0, str(line))

    unique = sorted(set(examples), key=order)[:_MAX_EXAMPLES]
    return {
        "total": sum(by_reason.values()),
        "by_reason": dict(sorted(by_reason.items())),
        "by_source": dict(sorted(by_source.items())),
        "examples": [f"{f}:{line}: {msg}" for f, line, msg in unique],
    }


def summary_line(summary: dict) -> str:
    """A :func:`summarize_bad_records` summary with bad records in one line: the count, per reason, and the first
    (``file:line: reason``)."""
    reasons = ", ".join(f"{n} {r}" for r, n in summary["by_reason"].items())
    return f"{summary['total']} bad record(s) skipped ({reasons}); first: {summary['examples'][0]}"


def refuse_skipped(bad: dict, policy: str, made: str) -> None:
    """Under ``bad_records: fail``, data made skipping bad records (a token-shard manifest's ``bad_records``) raises
    :class:`BadRecordError` with the first one (``file:line: reason``), as reading the text would have."""
    total = int(bad.get("total", 0))
    if policy == "fail" and total:
        first = (bad.get("examples") or ["(no example recorded)"])[0]
        raise BadRecordError(f"{first} (one of {total} bad record(s) that {made} was made skipping)")


def bad_record(reason: str, file: str, line: Any, detail: str = "") -> dict:
    """A bad record of ``reason`` (a key of :data:`REASONS`) at ``file:line``."""
    msg = REASONS[reason] + (f" ({detail})" if detail else "")
    return {"text": None, "bad": reason, "msg": msg, "file": file, "line": line}


def check_text(value: Any, has_field: bool, field_name: str, file: str, line: Any) -> dict:
    """Validate an extracted text field value, returning a good or a bad record."""
    if not has_field:
        return bad_record("missing_field", file, line, quote(field_name))
    if not isinstance(value, str):
        return bad_record("not_string", file, line, type(value).__name__)
    if not value.strip():
        return bad_record("empty", file, line)
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a JSON "\ud800" escape: no tokenizer or hash can take it
            return bad_record("bad_unicode", file, line, f"lone surrogate U+{ord(value[e.start]):04X}")
    return {"text": value, "bad": None, "msg": "", "file": file, "line": line}
