"""Mixtures of sources, the validation holdout and virtual document streams, all with exact state.

**Mixture.** Several sources are mixed by weight: draw ``j`` picks source ``i`` with probability
``weight_i / sum(weights)`` using a counter-based seeded RNG (block ``j // 1024`` of
``numpy.random.default_rng([seed, block])``), so the mixing position is one integer. Semantics are
those of ``datasets.interleave_datasets(probabilities=..., seed=..., stopping_strategy="all_exhausted")``:
an exhausted source restarts (oversampling) until every source has been exhausted once, which ends
the pass. We do not call ``interleave_datasets`` itself: it prefetches each source through a thread
pool, a thread hand-off per record that every virtual stream pays (each reads every record, below),
while this equivalent is one counter-based draw per record in the reading thread and keeps each
source's own ``datasets`` ``state_dict`` exact.

**Virtual streams.** Good training documents (bad records dropped, validation holdout removed) get
a global index ``i`` in mixture order; document ``i`` belongs to stream ``i % num_streams``. This is
exactly ``datasets.distributed.split_dataset_by_node(mixed, rank=s, world_size=num_streams)`` on the
filtered mixture (its ``StepExamplesIterable`` also reads every record and keeps one in S), written
out so that bad records can be attributed: a bad record is counted by the stream that owns the next
good document index, so over all streams each bad record is counted once per pass.

**Holdout.** A document is validation iff ``zlib.crc32(text.encode()) % 1_000_000 < val_holdout *
1_000_000``; training streams drop those, the validation stream keeps only those. A document of token shards
(its tokens, not its text) is held out by the CRC32 of its text, which the shards keep: the same documents as
from the text.

**Repeat.** When a stream's pass ends and ``repeat`` is set, it restarts from the beginning in the
same order with ``epoch += 1`` (the epoch is part of the state).
"""

from __future__ import annotations

import functools
import zlib
from typing import Literal

import numpy as np

from pretrain.config import ConfigError
from pretrain.data.bad_records import BadRecords
from pretrain.data.shards.mixed import mixed_supported, take_mixed
from pretrain.data.sources import ResolvedSource, open_reader

_BLOCK = 1024


@functools.lru_cache(maxsize=512)
def _block_choices(seed: int, cum: tuple[float, ...], block: int) -> np.ndarray:
    """The sources that draws ``[block * 1024, (block + 1) * 1024)`` of a mixture pick (``cum``: the cumulative
    normalized weights). A pure function, memoized: the virtual streams of a worker draw the same blocks."""
    u = np.random.default_rng([seed, block]).random(_BLOCK)
    choices = np.minimum(np.searchsorted(np.asarray(cum), u, side="right"), len(cum) - 1)
    choices.flags.writeable = False
    return choices


class Mixture:
    """One pass over several sources mixed by weight (``all_exhausted``), with an exact state."""

    def __init__(self, sources: list[ResolvedSource], seed: int, state: dict | None = None):
        if not sources:
            raise ValueError("data.sources: at least one source is required")
        self.sources = sources
        self.seed = int(seed) % (1 << 63)
        weights = np.array([s.weight for s in sources], dtype=np.float64)
        if (weights <= 0).any():
            raise ValueError("source weights must be > 0")
        self._cum = np.cumsum(weights / weights.sum())
        state = state or {}
        self.draws = int(state.get("draws", 0))
        self.exhausted = list(state.get("exhausted", [False] * len(sources)))
        reader_states = state.get("readers", [None] * len(sources))
        if len(self.exhausted) != len(sources) or len(reader_states) != len(sources):
            raise ValueError(f"data state: mixture of {len(reader_states)} sources, config has {len(sources)}")
        self.readers = [self._open(i, st) for i, st in enumerate(reader_states)]
        self._block = -1
        self._choices: np.ndarray | None = None

    def _open(self, i: int, state: dict | None = None):
        """A reader of source ``i`` from ``state`` (a hook: the driver's corpus check replays scanned records)."""
        return open_reader(self.sources[i], state)

    def _block_choices(self, block: int) -> np.ndarray:
        """The sources of draws ``[block * 1024, (block + 1) * 1024)``."""
        return _block_choices(self.seed, tuple(self._cum.tolist()), block)

    def choices(self, start: int, count: int) -> np.ndarray:
        """The sources of draws ``[start, start + count)`` (what ``count`` draws from ``start`` pick)."""
        first, last = start // _BLOCK, (start + count - 1) // _BLOCK
        blocks = np.concatenate([self._block_choices(b) for b in range(first, last + 1)])
        offset = start - first * _BLOCK
        return blocks[offset : offset + count]

    def _draw(self) -> int:
        if len(self.sources) == 1:
            return 0
        block, offset = divmod(self.draws, _BLOCK)
        if block != self._block:
            self._choices = self._block_choices(block)
            self._block = block
        self.draws += 1
        assert self._choices is not None  # drawn for block >= 0 above (_block starts at -1)
        return int(self._choices[offset])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if len(self.sources) == 1:
            return next(self.readers[0])
        while not all(self.exhausted):
            i = self._draw()
            try:
                return next(self.readers[i])
            except StopIteration:
                self.exhausted[i] = True
                self.readers[i] = self._open(i)
                if all(self.exhausted):
                    break
                try:
                    return next(self.readers[i])
                except StopIteration:  # an empty source: draw again
                    continue
        raise StopIteration

    def state_dict(self) -> dict:
        return {
            "draws": self.draws,
            "exhausted": list(self.exhausted),
            "readers": [r.state_dict() for r in self.readers],
        }


def is_holdout(text: str, val_holdout: float) -> bool:
    return val_holdout > 0 and zlib.crc32(text.encode("utf-8")) % 1_000_000 < val_holdout * 1_000_000


def crc_holdout(crc: int, val_holdout: float) -> bool:
    """:func:`is_holdout` from the text's CRC32 (token shards keep it per document)."""
    return val_holdout > 0 and crc % 1_000_000 < val_holdout * 1_000_000


def unique_documents(docs):
    """Documents once each (a document of token shards is compared by its tokens): a pass of a mixture's held-out
    documents reads a smaller source again until the largest ends."""
    seen: set = set()
    for doc in docs:
        key = doc if isinstance(doc, str) else doc.tobytes()
        if key not in seen:
            seen.add(key)
            yield doc


class DocumentStream:
    """Good documents of one role, dealt to virtual stream ``stream`` of ``num_streams``.

    ``role``: ``train`` (holdout removed), ``val`` (holdout only) or ``all`` (no holdout filter).
    State: ``{"epoch", "doc_index" (good documents of this role seen this pass), "mixture"}``; the
    bad-record counter is kept by the caller (it is passed in).
    """

    def __init__(
        self,
        sources: list[ResolvedSource],
        seed: int,
        *,
        role: Literal["train", "val", "all"],
        val_holdout: float,
        bad: BadRecords,
        stream: int = 0,
        num_streams: int = 1,
        repeat: bool = False,
        state: dict | None = None,
    ):
        if not 0 <= stream < num_streams:
            raise ValueError(f"stream {stream} out of range for {num_streams} streams")
        self.sources, self.seed, self.role = sources, seed, role
        self.val_holdout = val_holdout if role != "all" else 0.0
        self.bad, self.stream, self.num_streams, self.repeat = bad, stream, num_streams, repeat
        state = state or {}
        self.epoch = int(state.get("epoch", 0))
        self.doc_index = int(state.get("doc_index", 0))
        self.finished = bool(state.get("finished", False))
        self.mixture = Mixture(sources, seed, state.get("mixture"))
        if self.finished and repeat:  # the data ran out under data.repeat=false; resumed with repeat: the next pass
            self.finished = False
            self._restart()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "doc_index": self.doc_index,
            "finished": self.finished,
            "mixture": self.mixture.state_dict(),
        }

    def __iter__(self):
        return self

    def take_tokens(self, n_tokens: int, separator: int) -> np.ndarray | None:
        """The next documents, each followed by ``separator``, as one int64 array of at least ``n_tokens`` tokens
        (fewer when the data ends first; then the next call raises StopIteration): the packer's bulk path, where the
        sources are token-shard directories (one: :meth:`ShardReader.take_tokens`; a mixture:
        :func:`pretrain.data.shards.mixed.take_mixed`). None for any other sources: the caller reads document by
        document. The stream's state afterwards is the one those documents taken one by one leave."""
        if any(src.format != "shards" for src in self.sources) or not (
            len(self.sources) == 1 or mixed_supported(self.mixture)
        ):
            return None
        if self.finished:
            raise StopIteration
        holdout, want_val = self.val_holdout, self.role == "val"
        S, s = self.num_streams, self.stream
        pieces: list[np.ndarray] = []
        while n_tokens > 0:
            if len(self.sources) == 1:
                reader = self.mixture.readers[0]
                got, passed, ended = reader.take_tokens(
                    holdout, want_val, (s - self.doc_index) % S, S, n_tokens, separator
                )
            else:
                got, passed, ended = take_mixed(
                    self.mixture, holdout, want_val, s, S, self.doc_index, n_tokens, separator
                )
            self.doc_index += passed
            pieces.append(got)
            n_tokens -= len(got)
            if not ended:
                break
            if not self.repeat:
                self.finished = True
                break
            self._restart()
        return np.concatenate(pieces)

    def _restart(self) -> None:
        """A pass ended and ``repeat`` is set: the next epoch, from the start (refused when this stream got no
        document in the whole pass)."""
        if self.doc_index <= self.stream:
            what = "validation" if self.role == "val" else "training"
            raise ConfigError(
                f"virtual stream {self.stream} of {self.num_streams} got no {what} documents in a whole pass over the "
                f"data ({self.doc_index} documents): too little data for data.num_streams"
            )
        self.epoch += 1
        self.doc_index = 0
        self.mixture = Mixture(self.sources, self.seed)

    def __next__(self):
        """The next document: its text, or the tokens (a NumPy array) of a token-shard document."""
        if self.finished:
            raise StopIteration
        holdout, want_val = self.val_holdout, self.role == "val"
        S, s = self.num_streams, self.stream
        fast = len(self.sources) == 1 and self.sources[0].format == "shards"
        while True:
            try:
                if fast:  # one shard source: no bad records, the holdout by index blocks, other streams' skipped
                    load, passed = self.mixture.readers[0].next_kept(holdout, want_val, (s - self.doc_index) % S)
                    self.doc_index += passed
                    if load is None:
                        raise StopIteration
                    return load()
                row = next(self.mixture)
            except StopIteration:
                if not self.repeat:
                    self.finished = True
                    raise
                self._restart()
                continue
            if row["bad"] is not None:
                if self.doc_index % S == s or self.bad.policy == "fail":
                    self.bad.add(row)  # counted by one stream; under ``fail`` every stream raises
                continue
            text = row["text"]
            if text is None:  # a document of token shards: held out by its text's CRC32
                if holdout > 0 and crc_holdout(row["crc32"], holdout) != want_val:
                    continue
            elif holdout > 0 and is_holdout(text, holdout) != want_val:
                continue
            i = self.doc_index
            self.doc_index += 1
            if i % S == s:
                return text if text is not None else row["ids"]()  # shards: tokens read only for this stream's
