"""The in-context copying probe (``benchmarks/copying.py``): an exact copier, a model that ignores its context, and
a real ``transformers`` decoder."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks.copying import copying_probe
from tests.unit.eval.test_generate import llama  # noqa: F401 - the fixture is used by name

VOCAB = 50


class Copier(torch.nn.Module):
    """Knows the probe's period: from the second copy on, predicts the token one period back (logit 30); before it,
    uniform. So the first copy costs log(vocabulary) per token and every scored token of the second copy ~0."""

    def __init__(self, period: int) -> None:
        super().__init__()
        self.period = period
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, VOCAB)
        for p in range(self.period, input_ids.shape[1]):
            logits[torch.arange(len(input_ids)), p, input_ids[:, p - self.period + 1]] = 30.0
        return SimpleNamespace(logits=logits)


class Uniform(Copier):
    """Ignores its context: uniform everywhere."""

    def forward(self, input_ids):
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, VOCAB))


def test_a_copier_predicts_the_second_copy_and_a_context_blind_model_does_not():
    copier = copying_probe(Copier(6), VOCAB, sequences=8, length=6, seed=3)
    assert copier["second_copy"] < 1e-9, "only tokens the first copy predicts are scored in the second"
    assert copier["first_copy"] == pytest.approx(math.log(VOCAB))
    assert copier["gain"] == pytest.approx(copier["first_copy"] - copier["second_copy"])
    blind = copying_probe(Uniform(6), VOCAB, sequences=8, length=6)
    assert blind["first_copy"] == pytest.approx(math.log(VOCAB)) and blind["gain"] == pytest.approx(0.0, abs=1e-6)
    assert copying_probe(Copier(6), VOCAB, sequences=8, length=6, seed=3) == copier, "seeded"
    with pytest.raises(ValueError, match="length >= 2"):
        copying_probe(Copier(1), VOCAB, length=1)


def test_on_a_transformers_decoder(llama):  # noqa: F811
    model = llama.model.eval()
    r = copying_probe(model, model.config.vocab_size, sequences=4, length=8)
    assert all(math.isfinite(v) for v in r.values()) and r["first_copy"] > 0
