"""Packing documents into fixed-length sequences, and BERT-style MLM masking.

**Packing.** Documents are tokenized (batch encoding, no special tokens, no BOS) and concatenated,
each followed by the separator (eos); the concatenation is cut into sequences of exactly
``seq_len`` tokens. A document longer than the room left continues in the next sequence. The
tokens not yet emitted are the packer's *buffer*: every document pulled from the stream is
tokenized into it at once, so at any sequence boundary (document stream position, buffer) is an
exact, JSON-serializable resume point, whatever was partly consumed.

**Masking (encoders).** Positions are selected for prediction with probability ``mlm_probability``,
never on special tokens (separator, pad, mask, unk...). Of the selected positions 80% become the
mask token, 10% a uniformly random non-special token, 10% stay unchanged. ``labels`` holds the
original id at selected positions and -100 elsewhere. Each sequence has its own ``torch.Generator``
seeded by :func:`mask_seed` from (seed, stream, index of the sequence in its stream) -- or
(seed, "val", index) for validation -- so masks do not depend on the number of workers or on
resumption.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import numpy as np
import torch

IGNORE_INDEX = -100

BULK_TOKENS = 4096
"""The fewest tokens a packer reads at once from documents that hand over many at a time (``docs.take_tokens``):
reading ahead amortizes the per-read cost; what is read ahead waits in the buffer (part of the state)."""


class Packer:
    """Turns a document iterator into fixed-length token sequences (see the module docstring).

    The buffer is an int64 NumPy array. A document that is already tokens (a NumPy array: token shards) is copied
    into it whole, with no Python list of its ids; text documents are batch-encoded by ``encode`` in their place
    among them, so the sequences are the same whichever way a document arrives."""

    def __init__(
        self,
        docs: Iterator,
        encode: Callable[[list[str]], list[list[int]]],
        separator: int,
        seq_len: int,
        buffer: list[int] | None = None,
        estimate: list[float] | None = None,
    ):
        """``buffer`` and ``estimate``: a saved :attr:`buffer` and :attr:`estimate` (a resume reads ahead as the
        run it continues did)."""
        if seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {seq_len}")
        self.docs, self.encode, self.separator, self.seq_len = docs, encode, int(separator), seq_len
        self.buffer: np.ndarray = np.asarray(buffer if buffer else [], dtype=np.int64)
        self._sep = np.array([self.separator], dtype=np.int64)
        # running chars/token estimate: it decides how many documents a fill reads, so when a bad record is met
        self._chars, self._tokens = (float(x) for x in (estimate or (4000.0, 1000.0)))

    @property
    def estimate(self) -> list[float]:
        """The running characters and tokens of the chars/token estimate (part of a stream's state)."""
        return [self._chars, self._tokens]

    def fill(self, n_tokens: int) -> None:
        """Make the buffer hold at least ``n_tokens``; StopIteration when the documents end first. Documents that
        can hand over many documents' tokens at once (``docs.take_tokens``, token shards) are read that way."""
        bulk = getattr(self.docs, "take_tokens", None)
        while bulk is not None and len(self.buffer) < n_tokens:
            got = bulk(max(n_tokens - len(self.buffer), BULK_TOKENS), self.separator)
            if got is None:
                break  # these documents come one by one
            self.buffer = np.concatenate([self.buffer, got])
            if len(self.buffer) < n_tokens:
                raise StopIteration
        while len(self.buffer) < n_tokens:
            target = (n_tokens - len(self.buffer)) * self._chars / self._tokens
            docs: list = []
            chars = 0
            ended = False
            while chars < target:
                try:
                    doc = next(self.docs)
                except StopIteration:
                    ended = True
                    break
                docs.append(doc)
                chars += len(doc)
            if docs:
                texts = [d for d in docs if isinstance(d, str)]
                encoded = iter(self.encode(texts) if texts else [])
                pieces = [self.buffer]
                sep = self._sep
                for d in docs:
                    pieces.append(np.asarray(next(encoded), dtype=np.int64) if isinstance(d, str) else d)
                    pieces.append(sep)
                before = len(self.buffer)
                self.buffer = np.concatenate(pieces, dtype=np.int64)
                self._chars += chars
                self._tokens += len(self.buffer) - before
            if ended and len(self.buffer) < n_tokens:
                raise StopIteration

    def take(self, n_tokens: int) -> np.ndarray:
        out = self.buffer[:n_tokens]
        self.buffer = self.buffer[n_tokens:]
        return out

    def next_sequence(self) -> np.ndarray:
        self.fill(self.seq_len)
        return self.take(self.seq_len)


def mask_seed(seed: int, *key) -> int:
    """A 63-bit seed from ``(seed, *key)`` (a fixed formula: BLAKE2b of the repr)."""
    digest = hashlib.blake2b(repr((int(seed), *key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Masker:
    """BERT 80/10/10 masking of one sequence with its own seeded generator."""

    def __init__(self, tokenizer, probability: float):
        if not 0.0 < probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {probability}")
        from pretrain.data.tokenizer import mask_id

        self.mask_id = mask_id(tokenizer)
        vocab = len(tokenizer)
        special = sorted({int(i) for i in tokenizer.all_special_ids if i is not None and 0 <= i < vocab})
        self.probability = probability
        self.is_special = torch.zeros(vocab, dtype=torch.bool)
        self.is_special[special] = True
        self.random_ids = torch.nonzero(~self.is_special).flatten()

    def __call__(self, ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        n = ids.numel()
        select_u = torch.rand(n, generator=g)
        action_u = torch.rand(n, generator=g)
        random_pick = torch.randint(len(self.random_ids), (n,), generator=g)
        selected = (select_u < self.probability) & ~self.is_special[ids]
        labels = torch.where(selected, ids, IGNORE_INDEX)
        inputs = torch.where(selected & (action_u < 0.8), self.mask_id, ids)
        randomize = selected & (action_u >= 0.8) & (action_u < 0.9)
        inputs = torch.where(randomize, self.random_ids[random_pick], inputs)
        return inputs, labels


def make_example(
    ids: np.ndarray | list[int], kind: str, masker: Masker | None, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of one packed sequence: decoders predict every token (the model shifts)."""
    t = torch.tensor(np.asarray(ids, dtype=np.int64))
    if kind == "encoder":
        assert masker is not None  # encoders always pass one
        return masker(t, seed)
    return t, t.clone()
