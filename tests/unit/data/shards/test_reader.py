"""Reading shards (``pretrain/data/shards/reader.py``) and training from them: the same documents, tokens, holdout
and batches as from the text, exact and elastic resume."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.config import DataConfig, SourceConfig
from pretrain.data import merge_states, validation_sequences
from pretrain.data.shards.reader import INDEX_BLOCK, ShardReader, ShardSet, tokens_of
from pretrain.data.sources import SourceReader, resolve_source
from pretrain.data.tokenizer import make_encoder
from tests.unit.data.common import T, batches, data_cfg, make_docs, rows, steps, write_jsonl
from tests.unit.data.shards.common import build_shards


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


def test_reader_state_is_exact(shards, monkeypatch):
    s = ShardSet(shards)
    whole = [tokens_of(row).tolist() for row in ShardReader(s, "x")]
    assert whole == [s.document(i).tolist() for i in range(len(s))]
    monkeypatch.setattr("pretrain.data.shards.reader.INDEX_BLOCK", 7)  # index blocks that cut the documents
    assert [tokens_of(row).tolist() for row in ShardReader(s, "x")] == whole
    assert INDEX_BLOCK > 7
    r = ShardReader(s, "x")
    for _ in range(37):
        next(r)
    again = ShardReader(s, "x", r.state_dict())
    assert np.array_equal(tokens_of(next(again)), tokens_of(next(r))) and again.state_dict() == {"doc": 38}


@pytest.mark.parametrize("block", [INDEX_BLOCK, 7])
def test_training_from_shards_equals_training_from_text_with_holdout(corpus, tok, shards, block, monkeypatch):
    """A single shard source takes the block-wise path (``ShardReader.next_kept``); the same batches and validation
    set as the text, also when the index blocks are small."""
    monkeypatch.setattr("pretrain.data.shards.reader.INDEX_BLOCK", block)
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


def test_a_weighted_mixture_of_shard_directories_is_the_mixture_of_their_texts(corpus, tok, tok_dir, shards, tmp_path):
    other = write_jsonl(tmp_path / "other.jsonl", make_docs(400, "other", seed=5))
    build_shards(tmp_path / "other", [other], tok, tok_dir)

    def mix(a, b):
        return DataConfig(
            sources=[SourceConfig(path=str(a), weight=3.0), SourceConfig(path=str(b), weight=1.0)],
            num_streams=4,
            val_holdout=0.05,
        )

    from_text = [rows(x) for x in steps(batches(mix(corpus, other), tok), 6)]
    assert [rows(x) for x in steps(batches(mix(shards, tmp_path / "other"), tok), 6)] == from_text


@pytest.mark.parametrize("shard_tokens,block", [(1000, INDEX_BLOCK), (1 << 20, INDEX_BLOCK), (1 << 20, 7)])
def test_the_bulk_path_gives_the_text_batches_over_epochs_and_resumes_exactly(
    corpus, tok, tok_dir, tmp_path, shard_tokens, block, monkeypatch
):
    """A single shard source is packed in bulk (``ShardReader.take_tokens``: one gather per window of the index, one
    range at a time where the window crosses a shard): past the end of an epoch, with the holdout, the batches of
    the text; its state resumes exactly and elastically (2 workers -> 1)."""
    monkeypatch.setattr("pretrain.data.shards.reader.INDEX_BLOCK", block)
    manifest = build_shards(tmp_path / "shards", [corpus], tok, tok_dir, shard_tokens=shard_tokens)
    text_cfg = data_cfg(corpus, val_holdout=0.1, repeat=True)
    shard_cfg = data_cfg(tmp_path / "shards", val_holdout=0.1, repeat=True)
    G = 64
    n = 2 + int(1.2 * manifest.tokens / (G * T))
    want = [rows(x) for x in steps(batches(text_cfg, tok, G=G), n)]
    whole = batches(shard_cfg, tok, G=G)
    assert [rows(x) for x in steps(whole, n)] == want
    assert all(stream.docs.epoch == 1 for stream in whole._streams.values())  # every stream went past its pass
    two = [batches(shard_cfg, tok, rank=r, world=2, G=G) for r in range(2)]
    k = n // 2
    for tb in two:
        steps(tb, k)
    one = batches(shard_cfg, tok, G=G)
    one.load_state_dict(merge_states([tb.state_dict() for tb in two]))
    assert [rows(x) for x in steps(one, n - k)] == want[k:]


@pytest.mark.parametrize("shard_tokens,weights", [(1000, (3.0, 1.0)), (1 << 20, (1.0, 5.0))])
def test_a_mixture_of_shard_directories_in_bulk_is_its_texts_over_epochs_and_resumes(
    corpus, tok, tok_dir, tmp_path, shard_tokens, weights
):
    """Two shard directories mixed by weight are packed in bulk (``pretrain/data/shards/mixed.py``: a window of the
    mixture's draws at a time): over the end of the pass (the smaller source restarts, oversampled, until both have
    ended), with the holdout, the batches of the same mixture of texts; exact and elastic resume (2 workers -> 1)."""
    other = write_jsonl(tmp_path / "other.jsonl", make_docs(300, "other", seed=5))
    a = build_shards(tmp_path / "a", [corpus], tok, tok_dir, shard_tokens=shard_tokens)
    b = build_shards(tmp_path / "b", [other], tok, tok_dir, shard_tokens=shard_tokens)

    def mix(x, y):
        return DataConfig(
            sources=[SourceConfig(path=str(x), weight=weights[0]), SourceConfig(path=str(y), weight=weights[1])],
            num_streams=4,
            val_holdout=0.1,
            repeat=True,
        )

    G = 64
    one_pass = max(a.tokens / weights[0], b.tokens / weights[1]) * sum(weights)  # until both sources ended
    n = 2 + int(1.2 * one_pass / (G * T))
    want = [rows(x) for x in steps(batches(mix(corpus, other), tok, G=G), n)]
    whole = batches(mix(tmp_path / "a", tmp_path / "b"), tok, G=G)
    assert [rows(x) for x in steps(whole, n)] == want
    assert all(stream.docs.epoch >= 1 for stream in whole._streams.values())  # every stream went past its pass
    two = [batches(mix(tmp_path / "a", tmp_path / "b"), tok, rank=r, world=2, G=G) for r in range(2)]
    k = n // 2
    for tb in two:
        steps(tb, k)
    one = batches(mix(tmp_path / "a", tmp_path / "b"), tok, G=G)
    one.load_state_dict(merge_states([tb.state_dict() for tb in two]))
    assert [rows(x) for x in steps(one, n - k)] == want[k:]


@pytest.mark.parametrize("mixture", [False, True])
def test_bulk_reading_one_document_at_a_time_leaves_the_state_of_reading_document_by_document(
    corpus, tok, tok_dir, tmp_path, mixture
):
    """``DocumentStream.take_tokens(1)`` takes exactly one document: after each, the stream's state (mixture draws,
    ended sources, reader positions, documents passed, epoch) equals the document-by-document path's after the same
    document, at every position of two passes, for every stream (a stop that lands on a source's last document
    included)."""
    from pretrain.data.bad_records import BadRecords
    from pretrain.data.sources import training_sources
    from pretrain.data.stream import DocumentStream

    build_shards(tmp_path / "a", [corpus], tok, tok_dir, shard_tokens=1 << 20)
    paths = [tmp_path / "a"]
    if mixture:
        other = write_jsonl(tmp_path / "other.jsonl", make_docs(40, "other", seed=5))
        build_shards(tmp_path / "b", [other], tok, tok_dir, shard_tokens=1 << 20)
        paths.append(tmp_path / "b")
    cfg = DataConfig(sources=[SourceConfig(path=str(p), weight=1.0 + 2 * i) for i, p in enumerate(paths)])
    sources = training_sources(cfg)
    for s in range(3):
        docs = [
            DocumentStream(
                sources, 7, role="train", val_holdout=0.2, bad=BadRecords(), stream=s, num_streams=3, repeat=True
            )
            for _ in range(2)
        ]
        taken = 0
        while docs[0].epoch < 2:
            one = next(docs[0])
            bulk = docs[1].take_tokens(1, separator=-1)
            assert bulk is not None and bulk[-1] == -1 and np.array_equal(bulk[:-1], one)
            assert docs[1].state_dict() == docs[0].state_dict()
            taken += 1
            assert taken < 20_000


def test_a_document_of_no_tokens_at_the_very_end_reads_as_empty(tmp_path):
    """A document a tokenizer turns into no ids (a normaliser that drops control characters), last in a corpus whose
    tokens fill whole shards, starts past the last shard: it reads as empty, alone or in a batch."""
    import numpy as np

    from pretrain.data.shards.format import Manifest
    from pretrain.data.shards.writer import write_index, write_manifest, write_shards

    out = tmp_path / "shards"
    out.mkdir()
    shards = write_shards(out, [np.arange(8, dtype=np.uint16)], "uint16", 4, say=lambda line: None)
    index = write_index(out, np.array([3, 5, 0], np.uint64), np.array([1, 2, 3], np.uint32))
    manifest = Manifest(dtype="uint16", shard_tokens=4, tokens=8, documents=3, tokenizer={"vocab_size": 100},
                        sources=[], shards=shards, index=index)  # fmt: skip
    write_manifest(out, manifest)
    docs = ShardSet(out)
    assert [docs.document(i).tolist() for i in range(3)] == [[0, 1, 2], [3, 4, 5, 6, 7], []]
    tokens, passed, ended = ShardReader(docs, "x").take_tokens(0, False, 0, 1, 100, -1)
    assert tokens.tolist() == [0, 1, 2, -1, 3, 4, 5, 6, 7, -1, -1] and passed == 3 and ended
