"""The health probe's output-logit statistics (``pretrain/train/health.py``), taken chunk by chunk so that its fp32
copies stay small beside a large vocabulary's logits."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from pretrain.train import health


def test_logit_statistics_in_chunks_equal_the_whole_tensor(monkeypatch):
    monkeypatch.setattr(health, "LOGIT_CHUNK", 3 * 7)  # 3 rows of 7 at a time: 4 chunks, the last one short
    logits = (torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(0)) * 4).bfloat16()
    probe = health.HealthProbe(SimpleNamespace(module=torch.nn.Linear(2, 2)))
    probe.detach(SimpleNamespace(logits=logits))
    x = logits.float()
    torch.testing.assert_close(probe.sums["logit_ms"], x.pow(2).mean().item(), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        probe.sums["logsumexp_sq"], torch.logsumexp(x, -1).pow(2).mean().item(), rtol=1e-6, atol=0
    )
