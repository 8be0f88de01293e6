"""The architecture a fork's checks compare with its checkpoint's (``train CONFIG checkpoint.resume_from=DIR``):
the one the config gives the model at the checkpoint's step; the growth points it shares with the checkpoint's run.
The checks themselves, through the CLI:
``tests/integration/checkpoint/test_resume_guard.py``."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError
from pretrain.driver.resume import _as_built, _resolved_points
from tests.harness import tiny_config


def test_the_architecture_compared_is_the_configs_at_the_checkpoints_step():
    cfg = tiny_config("model.num_layers=2", "growth.schedule=[{at_step: 3, depth: 2x}, {at_step: 6, depth: 2x}]")
    saved = tiny_config("model.num_layers=4")
    assert _as_built(cfg, saved, step=3).model.num_layers == 2  # grows after step 3: its checkpoint is the model before
    assert _as_built(cfg, saved, step=4).model.num_layers == 4  # grown once
    assert _as_built(cfg, saved, step=6).model.num_layers == 4
    assert _as_built(cfg, saved, step=9).model.num_layers == 8
    assert _as_built(cfg, saved, step=4).train == cfg.train
    plain = tiny_config()
    assert _as_built(plain, saved, step=3) is plain
    with pytest.raises(ConfigError, match=r"^model\.init_from_hf \(/models/a\) with checkpoint\.resume_from: "):
        _as_built(tiny_config("model.init_from_hf=/models/a"), saved, step=1)


def test_a_fork_takes_the_steps_its_checkpoints_run_resolved_its_growth_points_to():
    given = (
        "growth.schedule=[{at_fraction: 0.1, depth: 2x}, {at_tokens: 640, depth: 2x}, {at_fraction: 0.5, depth: 2x}]"
    )
    cfg = tiny_config("model.num_layers=1", "train.max_flops=1e12", given)
    saved = tiny_config("model.num_layers=1", "train.max_flops=1e12", given)
    for entry, step in zip(saved.growth.schedule, (4, 9, 20)):
        entry.at_step = step  # as the run resolved them (its checkpoint's config.yaml)
    saved.growth.schedule[2].depth = "4x"  # not the same growth: no step taken from it
    _resolved_points(cfg, saved)
    assert [e.at_step for e in cfg.growth.schedule] == [4, 9, 0]
    assert _as_built(cfg, saved, step=10).model.num_layers == 4
    fixed = tiny_config("model.num_layers=1", "growth.schedule=[{at_step: 3, depth: 2x}]")
    _resolved_points(fixed, saved)
    assert fixed.growth.schedule[0].at_step == 3, "a step given stays"
