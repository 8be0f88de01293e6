"""The FLOPs arithmetic of the layer-dropout and early-exit studies (``benchmarks/layer_drop_quality.py``,
``benchmarks/early_exit_study.py``): what layer dropout leaves executed, by its mode and schedule."""

from __future__ import annotations

import pytest

from benchmarks.layer_drop_quality import executed_share
from pretrain.config import LayerDropConfig


def test_only_layer_mode_saves_flops_and_a_warm_up_is_counted():
    """A block that stochastic depth (``sample`` mode) drops still runs; a ``linear`` schedule reaches its rate
    only after its warm-up (the mean rate over the run, not the final one)."""
    steps, share, blocks = 1000, 0.8, 4
    constant = LayerDropConfig(rate=0.5, mode="layer")
    assert executed_share(constant, blocks, steps, share) == pytest.approx(1 - 0.8 * 0.5)
    assert executed_share(LayerDropConfig(rate=0.5, mode="sample"), blocks, steps, share) == 1.0
    assert executed_share(LayerDropConfig(rate=0.0), blocks, steps, share) == 1.0
    warm = LayerDropConfig(rate=0.5, schedule="linear", warmup_steps=steps, mode="layer")
    assert executed_share(warm, blocks, steps, share) == pytest.approx(1 - 0.8 * 0.5 * (steps - 1) / 2 / steps)
    deep = LayerDropConfig(rate=0.5, by_depth="linear", mode="layer")  # block l of L drops rate * (l + 1) / L
    assert executed_share(deep, blocks, steps, share) == pytest.approx(1 - 0.8 * 0.5 * 5 / 8)
