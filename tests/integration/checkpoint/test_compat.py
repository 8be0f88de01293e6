"""A checkpoint of an older layout (``tests/fixtures/old_checkpoint/step_00000002``, written by an older version
and kept unchanged) resumes through the command line and reproduces the uninterrupted run's step-4 losses
bitwise."""

from __future__ import annotations

import json
import shutil

from tests.conftest import FIXTURES
from tests.harness import cli
from tests.unit.checkpoint.test_reader import OLD


def test_old_checkpoint_resumes_bitwise(tmp_path):
    expected = json.loads((FIXTURES / "old_checkpoint" / "expected_step4.json").read_text())
    ckpt = shutil.copytree(OLD, tmp_path / "old" / OLD.name)
    cli(
        tmp_path,
        "resume",
        str(ckpt),
        "train.max_steps=4",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        expect=0,
        timeout=600,
    )
    (final,) = (tmp_path / "ckpt").glob("*/step_00000004/manifest.json")
    metrics = json.loads(final.read_text())["metrics"]
    assert metrics["train/loss"] == expected["train/loss"] and metrics["val/loss"] == expected["val/loss"], metrics
