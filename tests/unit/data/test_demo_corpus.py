"""The built-in demo corpus (``pretrain/data/demo_corpus.py``): real prose, deterministic, cached."""

from __future__ import annotations

import collections
import hashlib

import pytest

from pretrain.data import build_demo_corpus

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_demo_corpus_is_real_deterministic_and_cached(tmp_path):
    a = build_demo_corpus(tmp_path / "a")
    b = build_demo_corpus(tmp_path / "b")
    data = a.read_bytes()
    assert len(data) >= 1_200_000
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(b.read_bytes()).hexdigest()
    text = data.decode("utf-8")
    lines = text.splitlines()
    assert len(lines) > 5000 and all(line.strip() for line in lines)
    assert len(set(lines)) == len(lines)
    assert sum(c.isalpha() or c == " " for c in text) / len(text) > 0.9
    common = collections.Counter(w.lower() for w in text.split()).most_common(5)
    assert {"the", "a", "of", "to", "is"} & {w for w, _ in common}
    mtime = a.stat().st_mtime_ns
    assert build_demo_corpus(tmp_path / "a") == a and a.stat().st_mtime_ns == mtime  # reused
    a.write_text("corrupted\n")
    assert build_demo_corpus(tmp_path / "a").read_bytes() == data  # checksum mismatch: rebuilt
