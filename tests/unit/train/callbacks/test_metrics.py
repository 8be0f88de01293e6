"""``MetricsLogger`` (``pretrain/train/callbacks/metrics.py``): the losses since the last logged step travel in a
checkpoint, so a run resumed between two logged steps logs the ``train/loss_avg`` of the uninterrupted run."""

from __future__ import annotations

import json

from pretrain.train.callbacks.metrics import MetricsLogger


def test_the_window_of_losses_is_saved_and_restored_exactly():
    logger = MetricsLogger()
    logger.window = [5.123456789012345, 0.1 + 0.2, 4.0]  # the steps since the last logged one
    state = json.loads(json.dumps(logger.state_dict()))  # as a checkpoint holds it
    resumed = MetricsLogger()
    resumed.load_state_dict(state)
    assert resumed.window == logger.window and logger.name
