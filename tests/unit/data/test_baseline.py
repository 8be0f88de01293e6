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


def test_an_encoders_baseline_is_over_the_tokens_masking_selects(tmp_path, monkeypatch):
    """One-token documents: half the stream is the separator after each, which masking never selects. The
    encoder's baseline is the unigram of the tokens it is scored on (the specials' mass left out); counting the
    separator too would put it about ln 2 above that."""
    import torch

    from pretrain.data import baseline
    from pretrain.data.packing import IGNORE_INDEX

    words = ["a", "b", "c", "d"] * 50
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(words) + "\n")
    ids = {"a": 5, "b": 6, "c": 7, "d": 8}  # ids 0-3 special (1 the separator), 4 never seen
    tok = type("Tok", (), {"all_special_ids": [0, 1, 2, 3], "eos_token_id": 1, "__len__": lambda self: 9})()
    labels = torch.full((32,), IGNORE_INDEX)
    labels[::2] = torch.tensor([5, 6, 7, 8] * 4)  # the masked positions' targets
    monkeypatch.setattr(baseline, "make_encoder", lambda t: lambda texts: [[ids[x.strip()]] for x in texts])
    monkeypatch.setattr(baseline, "validation_sequences", lambda *a, **k: [(torch.zeros(32, dtype=torch.long), labels)])
    loss = baseline.unigram_baseline_loss(
        data_cfg(corpus, val_holdout=0.0), kind="encoder", seq_len=32, tokenizer=tok, val_sequences=1, seed=0
    )
    # each word 50 times in 200 non-special tokens, add-one over the 5 non-special ids
    assert loss == pytest.approx(-math.log((50 + 1) / (200 + 5)), rel=1e-9)


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
