"""``LayerDropCallback`` (``pretrain/train/callbacks/layer_drop.py``): the executed blocks since the last logged step
travel in a checkpoint, so a run resumed between two logged steps logs the ``train/active_layers`` of the
uninterrupted run. (The gates themselves: ``tests/unit/model/test_layerdrop.py``.)"""

from __future__ import annotations

import json

from pretrain.config import load_config
from pretrain.train.callbacks.layer_drop import LayerDropCallback


def test_the_executed_blocks_since_the_last_log_are_saved_and_restored():
    cfg = load_config(None, ["layer_drop.rate=0.5", "layer_drop.mode=layer", "model.num_layers=4"])
    run = LayerDropCallback(cfg, 0, [0])
    for step in (1, 2, 3):
        run.on_step_start(None, step)
    resumed = LayerDropCallback(cfg, 0, [0])
    resumed.load_state_dict(json.loads(json.dumps(run.state_dict())))  # as a checkpoint holds it
    run.on_step_start(None, 4)
    resumed.on_step_start(None, 4)
    assert resumed.extra_metrics() == run.extra_metrics() and run.name


def test_a_resumed_run_that_ends_before_its_first_step_validates_with_its_checkpoints_scales():
    """``rho`` scaling: a run resumed at step 500 whose data runs out at once is validated at its end with the
    scales of its last trained step (0-based 499), as ``eval`` and export of that checkpoint use, not step 0's."""
    from types import SimpleNamespace

    from pretrain.model.layerdrop import inference_scales

    cfg = load_config(
        None,
        [
            "layer_drop.rate=0.5",
            "layer_drop.mode=layer",
            "layer_drop.scaling=rho",
            "layer_drop.schedule=linear",
            "layer_drop.warmup_steps=1000",
            "model.num_layers=4",
            "train.max_steps=1000",
        ],
    )
    model = SimpleNamespace(branch_scales=None)
    trainer = SimpleNamespace(state=SimpleNamespace(step=500), module=SimpleNamespace(cfg=cfg, model=model))
    resumed = LayerDropCallback(cfg, 0, [0])
    resumed.on_run_start(trainer)
    resumed.on_run_end(trainer, {})
    assert model.branch_scales == inference_scales(cfg.layer_drop, 4, 499) != inference_scales(cfg.layer_drop, 4, 0)
