"""One virtual stream of the training batches (:mod:`pretrain.data.batches`): its documents, its packer, its shuffle
buffer (``data.shuffle_sequences``), its sequence counter and bad-record counter, and its exact state."""

from __future__ import annotations

import numpy as np

from pretrain.config import DataConfig
from pretrain.data.bad_records import BadRecords
from pretrain.data.packing import Packer, mask_seed
from pretrain.data.stream import DocumentStream


def train_holdout(cfg: DataConfig) -> float:
    """Fraction held out of the training sources (0 when validation comes from ``val_sources``)."""
    return 0.0 if cfg.val_sources else cfg.val_holdout


class PackedStream:
    """One virtual stream: its documents, packer, shuffle buffer (``data.shuffle_sequences``), sequence counter and
    bad-record counter."""

    def __init__(
        self,
        index: int,
        sources,
        cfg: DataConfig,
        seed: int,
        num_streams: int,
        encode,
        separator: int,
        seq_len: int,
        state: dict | None = None,
    ):
        state = state or {}
        self.index = index
        self.bad = BadRecords(cfg.bad_records)
        self.bad.load_state_dict(state.get("bad", {}))
        self.docs = DocumentStream(
            sources,
            seed,
            role="train",
            val_holdout=train_holdout(cfg),
            bad=self.bad,
            stream=index,
            num_streams=num_streams,
            repeat=cfg.repeat,
            state=state.get("documents"),
        )
        self.packer = Packer(self.docs, encode, separator, seq_len, state.get("buffer"), state.get("estimate"))
        self.sequences = int(state.get("sequences", 0))
        self.seed, self.seq_len, self.shuffle = seed, seq_len, cfg.shuffle_sequences
        self.pool = [np.asarray(x, dtype=np.int64) for x in state.get("shuffle_buffer", [])]

    def fill(self, n: int) -> None:
        """Make the next ``n`` sequences ready to take: their tokens packed, or with a shuffle buffer the buffer
        holding ``shuffle_sequences + n`` of them (fewer only at the end of the data); StopIteration when fewer
        than ``n`` are left."""
        T = self.seq_len
        if not self.shuffle:
            self.packer.fill(n * T)
            return
        try:
            while len(self.pool) < self.shuffle + n:
                self.packer.fill(T)
                self.pool.append(self.packer.take(T).copy())  # not a view keeping the packer's old buffer alive
        except StopIteration:
            if len(self.pool) < n:
                raise

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` sequences (after :meth:`fill`), concatenated: in packing order, or each drawn from the
        shuffle buffer at an index seeded by (seed, stream, its count)."""
        if not self.shuffle:
            out = self.packer.take(n * self.seq_len)
        else:
            picks = []
            for k in range(self.sequences, self.sequences + n):
                j = mask_seed(self.seed, "shuffle", self.index, k) % len(self.pool)
                picks.append(self.pool[j])
                self.pool[j] = self.pool[-1]
                self.pool.pop()
            out = np.concatenate(picks)
        self.sequences += n
        return out

    def state_dict(self, lists: bool = True) -> dict:
        """The stream's position; ``lists=False`` keeps the shuffle buffer's sequences as arrays (nothing changes
        them; :func:`as_lists` makes such a state JSON's)."""
        return {
            "documents": self.docs.state_dict(),
            "epoch": self.docs.epoch,
            "buffer": self.packer.buffer.tolist(),
            "estimate": self.packer.estimate,
            "sequences": self.sequences,
            "bad": self.bad.state_dict(),
            **({"shuffle_buffer": [x.tolist() if lists else x for x in self.pool]} if self.shuffle else {}),
        }


FRESH = ("buffer", "shuffle_buffer")
"""Keys of a stream's state that hold fresh lists (or arrays nothing changes): a snapshot does not copy them."""


def as_lists(state: dict) -> dict:
    """A state of the training batches (``{"streams": {...}, ...}``) with every stream's shuffle buffer as lists of
    ints."""
    streams = {}
    for key, st in state["streams"].items():
        pool = st.get("shuffle_buffer")
        streams[key] = {**st, "shuffle_buffer": [np.asarray(x).tolist() for x in pool]} if pool is not None else st
    return {**state, "streams": streams}
