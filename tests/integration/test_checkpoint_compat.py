"""Checkpoints written before the checkpoint layer still work: ``tests/fixtures/old_checkpoint/step_00000002`` was
written by the code before it (see the README there) and is kept unchanged. It exports with a passing parity
check, and resuming it reproduces the uninterrupted run's step-4 losses bitwise."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, cli_env

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "old_checkpoint"
OLD = FIXTURES / "step_00000002"


def test_old_checkpoint_exports(tmp_path):
    from pretrain.checkpoint import reader
    from pretrain.export.hf import export_checkpoint

    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)
    report = export_checkpoint(str(ckpt), tmp_path / "hf", log=lambda *a: None)
    assert report.hf_class == "LlamaForCausalLM" and report.max_abs_diff < 1e-4
    loaded = reader.load(reader.find_checkpoint(ckpt))
    assert loaded.trainer_state()["step"] == 2 and loaded.trainer_state()["sequences"] == 16
    assert sum(s["sequences"] for s in loaded.data_position()["streams"].values()) == 16


@pytest.mark.slow
def test_old_checkpoint_resumes_bitwise(tmp_path):
    expected = json.loads((FIXTURES / "expected_step4.json").read_text())
    ckpt = shutil.copytree(OLD, tmp_path / "old" / OLD.name)
    proc = subprocess.run([PYTHON, "-m", "pretrain", "resume", str(ckpt), "train.max_steps=4",
                           f"checkpoint.dir={tmp_path / 'ckpt'}", f"data.cache_dir={tmp_path / 'cache'}"],
                          cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (final,) = (tmp_path / "ckpt").glob("*/step_00000004/manifest.json")
    metrics = json.loads(final.read_text())["metrics"]
    assert metrics["train/loss"] == expected["train/loss"] and metrics["val/loss"] == expected["val/loss"], metrics
