"""A unigram baseline: the loss a model that ignores context would reach on the validation set.

An add-one-smoothed unigram distribution over the tokenizer's ``len(tokenizer)`` ids is estimated on
up to ``max_train_tokens`` training tokens (the training documents in mixture order, each followed by
the separator, exactly what the packer produces), then evaluated in nats/token on the validation
targets: ``input_ids[:, 1:]`` of every validation sequence for decoders, the positions with
``labels != -100`` for encoders. A model that learns anything should beat it quickly.

:func:`cached_unigram_baseline_loss` is what the end of a run calls: the value is kept in the user's cache
(:mod:`pretrain.user_cache`) under everything it depends on (the data settings, the identity of every source file,
the tokenizer's files, the sequence length, the number of validation sequences, the seed), so reruns, resumes and
runs of other models on the same data read it instead of recomputing it. Sources without a cheap identity (the hub,
token shards) are always recomputed.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from pathlib import Path

import numpy as np
import torch

from pretrain.config import DataConfig, to_dict
from pretrain.data.bad_records import BadRecords
from pretrain.data.batches import validation_sequences
from pretrain.data.packed_stream import train_holdout
from pretrain.data.sources import training_sources, validation_sources
from pretrain.data.stream import DocumentStream
from pretrain.data.tokenizer import make_encoder, separator_id
from pretrain.data.tokenizer_cache import sources_identity
from pretrain.user_cache import read_value, write_value

BASELINE_VERSION = 2  # 2: an encoder's unigram is over the tokens masking can select (no special tokens)
"""Bump when the baseline's computation or the documents and sequences it reads change: cached values then miss."""
MAX_TRAIN_TOKENS = 2_000_000


def unigram_baseline_loss(
    cfg: DataConfig,
    *,
    kind: str,
    seq_len: int,
    tokenizer,
    val_sequences: int,
    seed: int,
    max_train_tokens: int = MAX_TRAIN_TOKENS,
) -> float:
    vocab = len(tokenizer)
    counts = np.zeros(vocab, dtype=np.int64)
    encode, sep = make_encoder(tokenizer), separator_id(tokenizer)
    docs = DocumentStream(
        training_sources(cfg), seed, role="train", val_holdout=train_holdout(cfg), bad=BadRecords(cfg.bad_records)
    )
    seen = 0
    while seen < max_train_tokens:
        texts = list(itertools.islice(docs, 256))
        if not texts:
            break
        ids = [t for doc in encode(texts) for t in (*doc, sep)][: max_train_tokens - seen]
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab)[:vocab]
        seen += len(ids)
    if seen == 0:
        raise ValueError("unigram baseline: no training tokens")
    if kind == "encoder":  # masking never selects a special token (the separator after every document included)
        special = [int(i) for i in tokenizer.all_special_ids if i is not None and 0 <= i < vocab]
        counts[special] = 0
        log_p = torch.from_numpy(np.log(counts + 1.0) - math.log(counts.sum() + vocab - len(set(special))))
        log_p[special] = -math.inf  # (never a target)
    else:
        log_p = torch.from_numpy(np.log(counts + 1.0) - math.log(seen + vocab))

    val = validation_sequences(
        cfg, kind=kind, seq_len=seq_len, tokenizer=tokenizer, val_sequences=val_sequences, seed=seed
    )
    if not val:
        raise ValueError("unigram baseline: no validation data (val_holdout is 0 and no val_sources)")
    if kind == "decoder":
        targets = torch.cat([x[1:] for x, _ in val])
    else:
        targets = torch.cat([y[y != -100] for _, y in val])
    if targets.numel() == 0:
        raise ValueError("unigram baseline: the validation set has no targets")
    return float(-log_p[targets].mean())


def _tokenizer_identity(path: str) -> dict[str, str] | None:
    """SHA-256 of every file of a saved tokenizer directory; None when ``path`` is not one."""
    p = Path(path) if path else None
    if p is None or not p.is_dir():
        return None
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.iterdir()) if f.is_file()}


def baseline_spec(cfg: DataConfig, *, kind: str, seq_len: int, val_sequences: int, seed: int) -> dict | None:
    """Everything the baseline of ``cfg`` depends on (the cache's spec), or None when some of it has no cheap
    identity (a hub or token-shard source, a tokenizer that is not a saved directory)."""
    train = sources_identity(training_sources(cfg))
    val = sources_identity(validation_sources(cfg))
    tokenizer = _tokenizer_identity(cfg.tokenizer)
    if train is None or val is None or tokenizer is None:
        return None
    data = {k: v for k, v in to_dict(cfg).items() if k not in ("tokenizer", "cache_dir")}
    return {
        "version": BASELINE_VERSION,
        "data": data,
        "train": train,
        "val": val,
        "tokenizer": tokenizer,
        "kind": kind,
        "seq_len": seq_len,
        "val_sequences": val_sequences,
        "seed": seed,
        "max_train_tokens": MAX_TRAIN_TOKENS,
    }


def cached_unigram_baseline_loss(
    cfg: DataConfig, *, kind: str, seq_len: int, tokenizer, val_sequences: int, seed: int
) -> float:
    """:func:`unigram_baseline_loss`, read from the user's cache when it holds the value for exactly these inputs
    (:func:`baseline_spec`), else computed and stored."""
    spec = baseline_spec(cfg, kind=kind, seq_len=seq_len, val_sequences=val_sequences, seed=seed)
    cached = read_value("unigram-baseline", spec) if spec is not None else None
    if isinstance(cached, float):
        return cached
    value = unigram_baseline_loss(
        cfg, kind=kind, seq_len=seq_len, tokenizer=tokenizer, val_sequences=val_sequences, seed=seed
    )
    if spec is not None:
        write_value("unigram-baseline", spec, value)
    return value
