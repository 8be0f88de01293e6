"""The corpus and tokenizer the tests of ``pretrain/data`` share (trained once for the package)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.config import DataConfig, SourceConfig
from pretrain.data import load_or_train_tokenizer
from tests.unit.data.common import make_docs, write_txt


@pytest.fixture(scope="package")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    return write_txt(d / "docs.txt", make_docs(1500, "doc"), blank_every=50)


@pytest.fixture(scope="package")
def tok(corpus, tmp_path_factory):
    cfg = DataConfig(sources=[SourceConfig(path=str(corpus))], tokenizer_vocab_size=400, tokenizer_train_docs=1000)
    return load_or_train_tokenizer(cfg, tmp_path_factory.mktemp("tok"))
