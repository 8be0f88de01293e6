"""Whether the training documents are split by document or by sequence (called by
:func:`pretrain.data.sanity.check_corpus` on the driver, before Ray starts).

The plan decides how the training documents are split. Documents are dealt to the
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

import itertools
from dataclasses import dataclass
from pathlib import Path

from pretrain.config import ConfigError, DataConfig
from pretrain.data.shards.format import load_manifest
from pretrain.data.sources import ResolvedSource, cut_pieces, parse_line, prefix_lines, resolve_source
from pretrain.data.stream import Mixture, is_holdout

SCAN_BYTES = 64 << 20
SCAN_DRAWS = 10_000_000
CHARS_PER_TOKEN = 4  # a piece of about one sequence: CHARS_PER_TOKEN * seq_len characters


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
        for line in prefix_lines(rs.files, budget):
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
