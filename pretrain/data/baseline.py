"""A unigram baseline: the loss a model that ignores context would reach on the validation set.

An add-one-smoothed unigram distribution over the tokenizer's ``len(tokenizer)`` ids is estimated on
up to ``max_train_tokens`` training tokens (the training documents in mixture order, each followed by
the separator, exactly what the packer produces), then evaluated in nats/token on the validation
targets: ``input_ids[:, 1:]`` of every validation sequence for decoders, the positions with
``labels != -100`` for encoders. A model that learns anything should beat it quickly.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from pretrain.config import DataConfig
from pretrain.data.bad_records import BadRecords
from pretrain.data.batches import train_holdout, validation_sequences
from pretrain.data.sources import training_sources
from pretrain.data.stream import DocumentStream
from pretrain.data.tokenizer import make_encoder, separator_id


def unigram_baseline_loss(
    cfg: DataConfig,
    *,
    kind: str,
    seq_len: int,
    tokenizer,
    val_sequences: int,
    seed: int,
    max_train_tokens: int = 2_000_000,
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
