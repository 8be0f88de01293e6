"""The architecture a fork's checks compare with its checkpoint's (``train CONFIG checkpoint.resume_from=DIR``):
the one its workers build. The checks themselves, through the CLI: ``tests/integration/checkpoint/
test_resume_guard.py``."""

from __future__ import annotations

from pretrain.driver.resume import _as_built
from tests.harness import tiny_config


def test_the_architecture_compared_is_the_one_the_workers_build():
    cfg = tiny_config("growth.schedule=[{at_step: 3, depth: 2x}]")
    saved = tiny_config("model.num_layers=4", "model.init_from_hf=/models/a")
    assert _as_built(cfg, saved, step=2) is cfg  # not grown yet: the config's own
    assert _as_built(cfg, saved, step=3).model == saved.model  # grown at step 3: the checkpoint's, as the workers
    plain = tiny_config()
    assert _as_built(plain, saved, step=3) is plain
    same_hf = tiny_config("model.init_from_hf=/models/a")  # the HF model the checkpoint's run started from
    built = _as_built(same_hf, saved, step=1)
    assert built.model == saved.model and built.train == same_hf.train
