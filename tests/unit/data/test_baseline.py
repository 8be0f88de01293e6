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
