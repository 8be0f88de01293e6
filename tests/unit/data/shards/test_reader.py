"""Reading shards (``pretrain/data/shards/reader.py``) and training from them: the same documents, tokens, holdout
and batches as from the text, exact and elastic resume."""

from __future__ import annotations

import numpy as np

from pretrain.config import SourceConfig
from pretrain.data import merge_states, validation_sequences
from pretrain.data.shards.reader import ShardReader, ShardSet
from pretrain.data.sources import SourceReader, resolve_source
from pretrain.data.tokenizer import make_encoder
from tests.unit.data.common import batches, data_cfg, rows, steps


def test_documents_are_the_text_tokenized(corpus, tok, shards):
    texts = [r["text"] for r in SourceReader(resolve_source(SourceConfig(path=str(corpus)), ".")) if r["bad"] is None]
    s = ShardSet(shards)
    assert len(s) == len(texts)
    encoded = make_encoder(tok)(texts)
    spans = 0
    for i in range(len(s)):
        assert s.document(i).tolist() == encoded[i]
        spans += int(s.ends[i - 1] if i else 0) // 1000 != (int(s.ends[i]) - 1) // 1000
    assert spans > 0  # some documents span two shards


def test_reader_state_is_exact(shards):
    s = ShardSet(shards)
    r = ShardReader(s, "x")
    for _ in range(37):
        next(r)
    again = ShardReader(s, "x", r.state_dict())
    assert np.array_equal(next(again)["ids"], next(r)["ids"]) and again.state_dict() == {"doc": 38}


def test_training_from_shards_equals_training_from_text_with_holdout(corpus, tok, shards):
    text_cfg = data_cfg(corpus, val_holdout=0.1)
    shard_cfg = data_cfg(shards, val_holdout=0.1)
    a, b = steps(batches(text_cfg, tok), 6), steps(batches(shard_cfg, tok), 6)
    assert [rows(x) for x in a] == [rows(x) for x in b]
    va = validation_sequences(text_cfg, kind="decoder", seq_len=32, tokenizer=tok, val_sequences=4, seed=0)
    vb = validation_sequences(shard_cfg, kind="decoder", seq_len=32, tokenizer=tok, val_sequences=4, seed=0)
    assert [x.tolist() for x, _ in va] == [x.tolist() for x, _ in vb]


def test_exact_and_elastic_resume_from_shards(corpus, tok, shards):
    cfg = data_cfg(shards, corpus, val_holdout=0.05)  # a mixture of shards and text
    whole = [rows(x) for x in steps(batches(cfg, tok), 8)]
    two = [batches(cfg, tok, rank=r, world=2) for r in range(2)]
    for _ in range(3):
        for tb in two:
            tb.next_step()
    one = batches(cfg, tok)
    one.load_state_dict(merge_states([tb.state_dict() for tb in two]))
    assert [rows(x) for x in steps(one, 5)] == whole[3:]
