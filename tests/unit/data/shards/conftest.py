"""A shard directory of the package's corpus (``tests/unit/data/conftest.py``), built once for these tests."""

from __future__ import annotations

import pytest

from tests.unit.data.shards.common import build_shards


@pytest.fixture(scope="package")
def tok_dir(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("shard-tok")
    tok.save_pretrained(str(d))
    return d


@pytest.fixture(scope="package")
def shards(corpus, tok, tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "out"
    build_shards(out, [corpus], tok, tok_dir, shard_tokens=1000, chunk_bytes=8192)
    return out
