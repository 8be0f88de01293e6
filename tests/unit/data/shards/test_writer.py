"""Writing shards (``pretrain/data/shards/writer.py``): fixed sizes, atomic and idempotent, the manifest last."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.data.shards.format import MANIFEST, ShardError, load_manifest, shard_name
from pretrain.data.shards.reader import ShardSet
from pretrain.data.shards.writer import write_shards
from tests.unit.data.common import make_docs, write_parquet, write_txt
from tests.unit.data.shards.common import build_shards


def test_shards_have_exactly_shard_tokens_but_the_last(shards):
    m = load_manifest(shards)
    assert [r.tokens for r in m.shards[:-1]] == [1000] * (len(m.shards) - 1)
    assert 0 < m.shards[-1].tokens <= 1000 and sum(r.tokens for r in m.shards) == m.tokens
    all_tokens = np.concatenate([np.load(shards / shard_name(k)) for k in range(len(m.shards))])
    assert all_tokens.dtype == np.dtype("<u2") and all_tokens.size == m.tokens
    assert int(np.load(shards / "documents.npy")[-1]) == m.tokens
    assert not list(shards.glob(".*.tmp")) and not list(shards.glob("*.tmp"))


def test_a_rerun_writes_only_missing_or_damaged_shards(tmp_path):
    parts = [np.arange(i * 700, (i + 1) * 700, dtype=np.uint32) for i in range(5)]
    lines: list[str] = []
    first = write_shards(tmp_path, iter(parts), "uint16", 1000, say=lines.append)
    assert len(first) == 4 and lines[-1] == "4 shard(s), 4 written, 0 already in place"
    (tmp_path / shard_name(2)).unlink()
    (tmp_path / shard_name(0)).write_bytes(b"junk")
    mtime = (tmp_path / shard_name(1)).stat().st_mtime_ns
    again = write_shards(tmp_path, iter(parts), "uint16", 1000, say=lines.append)
    assert lines[-1] == "4 shard(s), 2 written, 2 already in place"
    assert again == first and (tmp_path / shard_name(1)).stat().st_mtime_ns == mtime


def test_the_output_does_not_depend_on_unit_size(corpus, tok, tok_dir, tmp_path):
    a = build_shards(tmp_path / "a", [corpus], tok, tok_dir, chunk_bytes=3000)
    b = build_shards(tmp_path / "b", [corpus], tok, tok_dir, chunk_bytes=1 << 30)
    assert [r.sha256 for r in a.shards + a.index] == [r.sha256 for r in b.shards + b.index]


def test_an_output_of_no_documents_is_refused_and_writes_no_manifest(tok, tok_dir, tmp_path):
    empty = write_txt(tmp_path / "blank.txt", ["  ", ""])
    with pytest.raises(ShardError, match="no documents to write"):
        build_shards(tmp_path / "out", [empty], tok, tok_dir)
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_parquet_shards_like_its_text(tok, tok_dir, tmp_path):
    docs = make_docs(300, "p")
    text = build_shards(tmp_path / "t", [write_txt(tmp_path / "d.txt", docs)], tok, tok_dir)
    parquet = build_shards(tmp_path / "p", [write_parquet(tmp_path / "d.parquet", docs)], tok, tok_dir)
    assert [r.sha256 for r in text.shards + text.index] == [r.sha256 for r in parquet.shards + parquet.index]
    assert len(ShardSet(tmp_path / "p")) == 300
