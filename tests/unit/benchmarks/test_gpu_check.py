"""The one GPU check's bookkeeping without its runs: a failing item does not stop the others and is reported failed
with the command's error; a failed training run fails what it measures; the results file's name and rows. The runs
themselves: ``tests/integration/bench/test_gpu_check.py``."""

from __future__ import annotations

import pytest

from benchmarks.gpu_check import Check, item


@pytest.fixture
def check(tmp_path):
    c = Check(tiny=True, steps=2, timeout=10, work=tmp_path)
    yield c
    c.session.close()


def test_a_failing_item_is_reported_with_its_error_and_the_check_goes_on(check, tmp_path):
    """... and each item is in the progress file as soon as it ends (a check cut short still leaves them)."""
    import json

    def broken() -> dict:
        raise RuntimeError("`train x.yaml` exited 2:\nerror: model.hidden_size: must be > 0")

    check.progress = tmp_path / "items.json"
    check.run("zero3", broken)
    assert list(json.loads(check.progress.read_text())) == ["zero3"]
    check.run("moe", lambda: item("pass", "losses 1 -> 0.5"))
    assert json.loads(check.progress.read_text()) == check.items
    assert (
        check.items["zero3"]["status"] == "fail" and "model.hidden_size: must be > 0" in check.items["zero3"]["figure"]
    )
    assert check.items["moe"] == {
        "status": "pass",
        "figure": "losses 1 -> 0.5",
        "seconds": check.items["moe"]["seconds"],
    }


def test_a_failed_training_run_fails_what_it_measures(check):
    def broken() -> dict:
        raise RuntimeError("out of memory")

    check.run("train", broken)
    assert {k: v["status"] for k, v in check.items.items()} == {"train": "fail", "mfu": "fail", "sdpa_kernel": "fail"}
    with pytest.raises(RuntimeError, match="needs the train item's run"):
        check.export()


def test_a_gpu_that_torch_cannot_use_fails_the_check_instead_of_the_cpu_size(tmp_path, monkeypatch):
    """On a machine with an NVIDIA driver, a torch that cannot use the GPU (a CPU build, a driver older than its
    CUDA) is refused in one line: never the tiny CPU check reported as passed. Without a driver: the tiny size."""
    import benchmarks.gpu_check as gc
    from pretrain.config import ConfigError

    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\n")
    assert gc.gpu_driver(version) == "NVRM version: NVIDIA UNIX x86_64 Kernel Module 535.183.01"
    assert gc.gpu_driver(tmp_path / "none") == ""
    monkeypatch.setattr(gc.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gc, "gpu_driver", lambda: "NVRM version: NVIDIA UNIX x86_64 Kernel Module 535.183.01")
    with pytest.raises(ConfigError, match=r"^bench --gpu: this machine has an NVIDIA driver \(NVRM .* 535\.183\.01\) "):
        gc.main(["--gpu", "--dir", str(tmp_path / "runs")])


def test_the_scripts_exit_status_is_setups_when_setup_fails(tmp_path):
    """``gpu_check.sh`` on a machine lent for minutes: a setup that fails is its exit status (a device run that
    reported 0 and no results would read as a pass)."""
    import subprocess

    from tests.conftest import ROOT

    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path / "no-wheelhouse"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "[gpu-check] setup --offline failed (exit 2)" in proc.stderr, proc.stderr


def test_only_the_timed_run_compiles(check):
    """On CUDA ``train.compile`` is on by default: the runs that check a feature turn it off (each is a new process
    that would compile the blocks again: minutes of a ten-minute window); the timed run and its dry run keep it."""
    check.gpu = True
    assert "train.compile=no" not in check.timed()
    for config in ("gpt-125m", "demo-moe", "demo-decoder"):
        assert "train.compile=no" in check.base(config, "train.max_steps=1")
