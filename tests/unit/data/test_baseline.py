"""The unigram baseline (``pretrain/data/baseline.py``)."""

from __future__ import annotations

import math

import pytest

from pretrain.data import unigram_baseline_loss
from tests.unit.data.common import T, data_cfg

pytestmark = pytest.mark.usefixtures("datasets_cache")


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_unigram_baseline(corpus, tok, kind):
    cfg = data_cfg(corpus, val_holdout=0.1)
    loss = unigram_baseline_loss(cfg, kind=kind, seq_len=T, tokenizer=tok, val_sequences=32, seed=7)
    assert math.isfinite(loss) and 1.0 < loss < math.log(len(tok))


def test_the_cached_baseline_is_the_computed_one_for_exactly_its_inputs(corpus, tok, cache, tmp_path, monkeypatch):
    """``cached_unigram_baseline_loss`` (the end of every run): the first call computes and stores the value; the
    same inputs read it back (the computation is not run); a change of the corpus file, the tokenizer's files, the
    sequence length or the seed is a miss; a hub source is never cached."""
    import shutil

    from pretrain.config import SourceConfig
    from pretrain.data import baseline
    from pretrain.data.baseline import baseline_spec, cached_unigram_baseline_loss

    data = shutil.copyfile(corpus, tmp_path / "docs.txt")
    tok.save_pretrained(tmp_path / "tok")
    cfg = data_cfg(data, val_holdout=0.1, tokenizer=str(tmp_path / "tok"))
    args = dict(kind="decoder", seq_len=T, tokenizer=tok, val_sequences=16, seed=7)
    fresh = unigram_baseline_loss(cfg, **args)
    assert cached_unigram_baseline_loss(cfg, **args) == fresh
    calls = []
    real = baseline.unigram_baseline_loss
    monkeypatch.setattr(baseline, "unigram_baseline_loss", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert cached_unigram_baseline_loss(cfg, **args) == fresh and calls == []  # read back
    cached_unigram_baseline_loss(cfg, **{**args, "seq_len": T // 2})
    cached_unigram_baseline_loss(cfg, **{**args, "seed": 8})
    assert len(calls) == 2
    spec = baseline_spec(cfg, kind="decoder", seq_len=T, val_sequences=16, seed=7)
    with open(data, "a") as f:
        f.write("one more document\n")
    assert baseline_spec(cfg, kind="decoder", seq_len=T, val_sequences=16, seed=7) != spec
    (tmp_path / "tok" / "extra.json").write_text("{}")
    assert baseline_spec(cfg, kind="decoder", seq_len=T, val_sequences=16, seed=7)["tokenizer"] != spec["tokenizer"]
    hub = data_cfg(data, tokenizer=str(tmp_path / "tok"))
    hub.sources = [SourceConfig(path="org/some-dataset", format="hub")]
    assert baseline_spec(hub, kind="decoder", seq_len=T, val_sequences=16, seed=7) is None
