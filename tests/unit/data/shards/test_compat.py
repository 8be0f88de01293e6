"""The run's tokenizer against the shards' (``pretrain/data/shards/compat.py``)."""

from __future__ import annotations

import json
import shutil

import pytest

from pretrain.config import ConfigError
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
