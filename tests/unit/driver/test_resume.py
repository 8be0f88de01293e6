"""The architecture a fork's checks compare with its checkpoint's (``train CONFIG checkpoint.resume_from=DIR``):
the one the config gives the model at the checkpoint's step. The checks themselves, through the CLI:
``tests/integration/checkpoint/test_resume_guard.py``."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError
from pretrain.driver.resume import _as_built
from tests.harness import tiny_config


def test_the_architecture_compared_is_the_configs_at_the_checkpoints_step():
    cfg = tiny_config("model.num_layers=2", "growth.schedule=[{at_step: 3, depth: 2x}, {at_step: 6, depth: 2x}]")
    saved = tiny_config("model.num_layers=4")
    assert _as_built(cfg, saved, step=2).model.num_layers == 2  # not grown yet
    assert _as_built(cfg, saved, step=3).model.num_layers == 4  # grown once at step 3
    assert _as_built(cfg, saved, step=9).model.num_layers == 8
    assert _as_built(cfg, saved, step=3).train == cfg.train
    plain = tiny_config()
    assert _as_built(plain, saved, step=3) is plain
    with pytest.raises(ConfigError, match=r"^model\.init_from_hf \(/models/a\) with checkpoint\.resume_from: "):
        _as_built(tiny_config("model.init_from_hf=/models/a"), saved, step=1)
