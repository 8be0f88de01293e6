"""The run's tokenizer against the shards' (``pretrain/data/shards/compat.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pretrain.config import ConfigError, SourceConfig
from pretrain.data.shards.compat import shards_tokenizer, tokenizer_vocab_size
from tests.unit.data.common import data_cfg


def _other(tok_dir, tmp_path):
    """The same vocabulary, another tokenizer (its decoder differs): only the sha256 tells them apart."""
    other = shutil.copytree(tok_dir, tmp_path / "other")
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["decoder"]["trim_offsets"] = not spec["decoder"].get("trim_offsets", True)
    (other / "tokenizer.json").write_text(json.dumps(spec))
    assert tokenizer_vocab_size(other) == tokenizer_vocab_size(tok_dir)
    return other


def test_the_shards_tokenizer_is_the_runs_unless_another_is_given(corpus, shards, tok, tok_dir, tmp_path):
    assert shards_tokenizer(data_cfg(corpus)) == ""
    assert shards_tokenizer(data_cfg(shards, corpus)) == str(shards / "tokenizer")
    assert tokenizer_vocab_size(shards / "tokenizer") == len(tok)
    assert shards_tokenizer(data_cfg(shards, tokenizer=str(tok_dir))) == str(tok_dir)  # the same one, saved apart
    with pytest.raises(ConfigError, match=r"data.tokenizer: .* is not the tokenizer of the shards .* sha256"):
        shards_tokenizer(data_cfg(shards, tokenizer=str(_other(tok_dir, tmp_path))))


def test_shard_directories_of_different_tokenizers_are_refused(shards, tok_dir, tmp_path):
    copy = shutil.copytree(shards, tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"data.sources\[1\]: the shards in .* were made with another tokenizer"):
        shards_tokenizer(data_cfg(shards, copy))


def test_too_few_shard_documents_for_the_streams_and_a_nested_shard_directory(corpus, shards, tok, tok_dir, tmp_path):
    """Shards are never cut into pieces: fewer documents than streams is one line before the run (not a traceback
    in its first pass). A shard directory inside a corpus directory is not read as its JSON records."""
    from pretrain.data.sources import resolve_source
    from pretrain.data.split_plan import plan_split
    from tests.unit.data.shards.common import build_shards

    two = tmp_path / "two.txt"
    two.write_text("alpha beta gamma delta\nepsilon zeta eta theta\n")
    few = tmp_path / "few"
    assert build_shards(few, [two], tok, tok_dir).documents == 2
    with pytest.raises(ConfigError) as e:
        plan_split(data_cfg(few), seq_len=16, seed=0, val_sequences=0)
    assert str(e.value) == (
        "data.sources: the token shards hold 2 documents, fewer than the data.num_streams=4 streams that each need "
        "one (shards are not cut into pieces): lower data.num_streams, or tokenize more text"
    )
    assert plan_split(data_cfg(few, num_streams=2), seq_len=16, seed=0, val_sequences=0).piece_chars == 0

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    shutil.copy(corpus, corpus_dir / "a.jsonl" if str(corpus).endswith(".jsonl") else corpus_dir / "a.txt")
    shutil.copytree(shards, corpus_dir / "shards")  # ./launch.sh tokenize corpus --out corpus/shards
    (corpus_dir / "notes").mkdir()  # a manifest.json of something else hides nothing beside it
    (corpus_dir / "notes" / "manifest.json").write_text('{"files": []}')
    (corpus_dir / "notes" / "b.txt").write_text("more text\n")
    rs = resolve_source(SourceConfig(path=str(corpus_dir), format="text"), ".")
    assert [str(Path(f).relative_to(corpus_dir)) for f in rs.files] == [
        next(corpus_dir.glob("a.*")).name,
        "notes/b.txt",
        "notes/manifest.json",
    ]
