"""The packer's bulk path over a mixture of token-shard directories: a window of the mixture's draws at a time.

What :class:`~pretrain.data.stream.DocumentStream` does draw by draw (see :mod:`pretrain.data.stream`: a draw picks a
source by weight, the source's reader gives its next document, restarting when it ends until every source has ended
once; the held-out documents are dropped; the kept ones are dealt to the virtual streams in turn), done for a window
of draws with NumPy: the draws' sources from the mixture's counter-based generator, each draw's document from its
source's position (``(position + k) mod documents`` for its ``k``-th draw in the window), the holdout from the
documents' CRC32s, the stream's share by the kept documents' running index, and the tokens of the documents it keeps
gathered from each source's mapping. The mixture (draws, ended sources, reader positions) and the returned count of
documents of the role passed are those the draw-by-draw path leaves after the same documents.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pretrain.data.shards.reader import ShardReader


class Mixture(Protocol):
    """What this module reads and advances of a :class:`pretrain.data.stream.Mixture` (which imports this one)."""

    readers: list
    exhausted: list[bool]
    draws: int

    def choices(self, start: int, count: int) -> np.ndarray: ...


MAX_WINDOW = 1 << 16
"""The most draws looked at in one go."""


def mixed_supported(mixture: Mixture) -> bool:
    """Whether :func:`take_mixed` can read ``mixture``: two or more token-shard sources, none of them empty."""
    readers = mixture.readers
    return len(readers) > 1 and all(isinstance(r, ShardReader) and len(r.shards) > 0 for r in readers)


def take_mixed(
    mixture: Mixture,
    holdout: float,
    want_val: bool,
    stream: int,
    num_streams: int,
    doc_index: int,
    n_tokens: int,
    separator: int,
) -> tuple[np.ndarray, int, bool]:
    """The documents of the role dealt to ``stream`` of ``num_streams`` (``doc_index``: documents of the role passed
    so far this pass), each followed by ``separator``, until they hold ``n_tokens`` tokens or the pass ends.
    Returns (their tokens, int64; documents of the role passed, the last taken included; whether the pass ended
    first). Advances ``mixture`` (see the module docstring)."""
    readers: list[ShardReader] = mixture.readers
    sizes = np.array([len(r.shards) for r in readers], dtype=np.int64)
    mean = max(1.0, sum(int(r.shards.ends[-1]) for r in readers) / float(sizes.sum()))
    pieces: list[np.ndarray] = []
    got = passed = 0
    while True:
        keep_rate = holdout if want_val else 1.0 - holdout
        want = (n_tokens - got) * num_streams / (mean + 1) / max(keep_rate, 1e-3)
        window = int(min(MAX_WINDOW, 64 + 2 * want))
        src = mixture.choices(mixture.draws, window)
        doc = np.empty(window, dtype=np.int64)
        pos = np.array([r.doc for r in readers], dtype=np.int64)
        ends_at: list[int] = []  # the draw at which each source that has not ended yet finds its end
        for i in range(len(readers)):
            at = np.flatnonzero(src == i)
            doc[at] = (pos[i] + np.arange(len(at))) % sizes[i]
            if not mixture.exhausted[i]:
                first = int(sizes[i] - pos[i])  # its k-th draw in the window reads past its last document
                ends_at.append(int(at[first]) if first < len(at) else window)
        end = max(ends_at) if ends_at else window  # the draw that ends the pass, or none in the window
        ending = end < window
        rows = np.arange(end)
        kept = rows if holdout <= 0 else rows[_held_out(readers, src[:end], doc[:end], holdout) == want_val]
        order = doc_index + passed + np.arange(len(kept))
        mine = kept[order % num_streams == stream]
        starts, stops = _spans(readers, src[mine], doc[mine])
        lengths = stops - starts + 1
        room = lengths.cumsum()
        m = min(int(room.searchsorted(n_tokens - got)) + 1, len(mine)) if len(mine) else 0
        if m and int(room[m - 1]) >= n_tokens - got:  # enough: stop after this stream's m-th document
            used = int(mine[m - 1]) + 1
            pieces.append(_gather(readers, src[mine[:m]], starts[:m], stops[:m], lengths[:m], room[:m], separator))
            passed += int(np.searchsorted(kept, used))
            _advance(mixture, src[:used], pos, sizes)
            return _join(pieces), passed, False
        if m:
            pieces.append(_gather(readers, src[mine], starts, stops, lengths, room, separator))
            got += int(room[-1])
        passed += len(kept)
        _advance(mixture, src[:end], pos, sizes)
        if ending:  # the draw at ``end`` found the last source that had not ended at its end: the pass is over
            mixture.draws += 1
            mixture.exhausted = [True] * len(readers)
            return _join(pieces), passed, True


def _join(pieces: list[np.ndarray]) -> np.ndarray:
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _held_out(readers: list[ShardReader], src: np.ndarray, doc: np.ndarray, holdout: float) -> np.ndarray:
    """Whether each (source, document) is held out (by the CRC32 of its text, as :func:`crc_holdout`)."""
    crc = np.empty(len(src), dtype=np.int64)
    for i, r in enumerate(readers):
        at = np.flatnonzero(src == i)
        if len(at):
            crc[at] = r.shards.crc32[doc[at]]
    return crc % 1_000_000 < holdout * 1_000_000


def _spans(readers: list[ShardReader], src: np.ndarray, doc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The global token spans ``[start, end)`` of each (source, document), in its source's shards."""
    starts = np.empty(len(src), dtype=np.int64)
    stops = np.empty(len(src), dtype=np.int64)
    for i, r in enumerate(readers):
        at = np.flatnonzero(src == i)
        if len(at):
            d = doc[at]
            stops[at] = r.shards.ends[d]
            starts[at] = np.where(d > 0, r.shards.ends[np.maximum(d - 1, 0)], 0)
    return starts, stops


def _gather(
    readers: list[ShardReader],
    src: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    lengths: np.ndarray,
    room: np.ndarray,
    separator: int,
) -> np.ndarray:
    """The documents' tokens, each followed by ``separator``, in their order (each source's gathered at once)."""
    out = np.empty(int(room[-1]), dtype=np.int64)
    out_starts = room - lengths
    for i, r in enumerate(readers):
        at = np.flatnonzero(src == i)
        if not len(at):
            continue
        ln = lengths[at]
        part = r.gather(starts[at], stops[at], ln, ln.cumsum(), separator)
        local = ln.cumsum() - ln
        out[np.arange(len(part), dtype=np.int64) + (out_starts[at] - local).repeat(ln)] = part
    return out


def _advance(mixture: Mixture, src: np.ndarray, pos: np.ndarray, sizes: np.ndarray) -> None:
    """The mixture after the draws ``src`` (from ``pos``, the readers' positions before them)."""
    counts = np.bincount(src, minlength=len(sizes))
    for i, r in enumerate(mixture.readers):
        k = int(counts[i])
        if k:
            if pos[i] + k > sizes[i]:
                mixture.exhausted[i] = True
            r.doc = int((pos[i] + k - 1) % sizes[i]) + 1
    mixture.draws += len(src)
