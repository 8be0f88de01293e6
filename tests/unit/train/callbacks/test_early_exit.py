"""Per-exit validation (``evaluate_exits``) in one process against its definition: each exit's token-weighted loss,
the fraction of predicted positions where its greedy token is the full model's, and that acceptance's speed-up
bound."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pretrain.model import build_model
from pretrain.model.early_exit import speedup_bound
from pretrain.model.score import mean_cross_entropy
from pretrain.train.callbacks.early_exit import evaluate_exits
from tests.harness import tiny_config


def test_exit_metrics_follow_their_definition():
    cfg = tiny_config("model.num_layers=4", "model.dropout=0.0")
    model = build_model(cfg.model, seed=2)
    g = torch.Generator().manual_seed(0)
    batches = []
    for rows in (2, 3):  # micro-batches of different sizes and targets: the metrics are token-weighted
        ids = torch.randint(0, cfg.model.vocab_size, (rows, 16), generator=g)
        labels = ids.clone()
        labels[0, : 3 * rows] = -100
        batches.append({"input_ids": ids, "labels": labels})
    module = SimpleNamespace(engine=model, device=torch.device("cpu"), rank=0)

    got = evaluate_exits(module, batches, [(1, 1.0), (3, 1.0)], 4)

    assert sorted(got) == [f"val/exit_{d}/{k}" for d in (1, 3) for k in ("acceptance", "loss", "speedup_bound")]
    model.eval()
    with torch.no_grad():
        for depth in (1, 3):
            nats = tokens = same = 0.0
            for mb in batches:
                ids, labels = mb["input_ids"], mb["labels"]
                full = model(ids).logits[:, :-1].argmax(-1)
                cut = model(ids, layer_mask=[i < depth for i in range(4)]).logits
                keep = labels[:, 1:] != -100
                n = float(keep.sum())
                nats += mean_cross_entropy(cut, labels, causal=True).item() * n
                tokens += n
                same += float(((cut[:, :-1].argmax(-1) == full) & keep).sum())
            assert got[f"val/exit_{depth}/loss"] == pytest.approx(nats / tokens, rel=1e-6)
            assert got[f"val/exit_{depth}/acceptance"] == pytest.approx(same / tokens, abs=1e-12)
            bound = speedup_bound(got[f"val/exit_{depth}/acceptance"], depth, 4)["speedup"]
            assert got[f"val/exit_{depth}/speedup_bound"] == bound
    assert 0 < got["val/exit_3/acceptance"] <= 1


def test_the_trained_exits_window_survives_a_resume():
    """``early_exit/trained_exits`` averages the steps since the last log: a run resumed between two logs logs the
    value the uninterrupted run logs (the window is in the checkpoint's callback state)."""
    from pretrain.train.callbacks.early_exit import EarlyExitCallback

    cfg = tiny_config(
        "model.num_layers=4",
        "layer_drop.early_exit.layers=[1,3]",
        "layer_drop.early_exit.curriculum=gradual",
        "train.max_steps=20",
    )
    whole, first = EarlyExitCallback(cfg), EarlyExitCallback(cfg)
    for step in range(1, 21):
        whole.on_step_start(None, step)
        if step <= 15:
            first.on_step_start(None, step)
    resumed = EarlyExitCallback(cfg)
    resumed.load_state_dict(first.state_dict())
    for step in range(16, 21):
        resumed.on_step_start(None, step)
    assert resumed.extra_metrics() == whole.extra_metrics()
    assert whole.name == "early_exit_window"


def test_a_resume_that_trains_longer_keeps_the_exits_the_run_trains():
    """``gradual`` switches exits on at fractions of the run it was planned for (kept in the checkpoint): a resume
    that raises ``train.max_steps`` (the printed "train on" command) goes on training every exit switched on, it
    does not switch them off again as fractions of the longer run."""
    import dataclasses

    from pretrain.train.callbacks.early_exit import EarlyExitCallback

    cfg = tiny_config(
        "model.num_layers=4",
        "layer_drop.early_exit.layers=[1,2,3]",
        "layer_drop.early_exit.curriculum=gradual",
        "layer_drop.early_exit.gradual_fraction=0.9",
        "train.max_steps=100",
    )
    run = EarlyExitCallback(cfg)
    run.on_step_start(None, 100)
    assert [d for d, _ in run.exits] == [1, 2, 3]
    longer = EarlyExitCallback(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=200)))
    longer.load_state_dict(run.state_dict())
    longer.on_step_start(None, 101)
    assert [d for d, _ in longer.exits] == [1, 2, 3]
