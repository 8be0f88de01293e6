"""Checkpoints of an older layout still work: ``tests/fixtures/old_checkpoint/step_00000002`` was written by an
older version (see the README there) and is kept unchanged. It exports with a passing parity check; its bitwise
resume is in ``tests/integration/checkpoint/test_compat.py``."""

from __future__ import annotations

import shutil

from tests.conftest import FIXTURES

OLD = FIXTURES / "old_checkpoint" / "step_00000002"


def test_old_checkpoint_exports(tmp_path):
    from pretrain.checkpoint import reader
    from pretrain.export.hf import export_checkpoint

    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)
    report = export_checkpoint(str(ckpt), tmp_path / "hf", log=lambda *a: None)
    assert report.hf_class == "LlamaForCausalLM" and report.max_abs_diff < 1e-4
    loaded = reader.load(reader.find_checkpoint(ckpt))
    assert loaded.trainer_state()["step"] == 2 and loaded.trainer_state()["sequences"] == 16
    assert sum(s["sequences"] for s in loaded.data_position()["streams"].values()) == 16
