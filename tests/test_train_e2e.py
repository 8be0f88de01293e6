"""End to end through the real CLI, real Ray Train (2 workers, gloo), real MLflow (sqlite):
training, exact resume from a checkpoint, and resume of a killed job by run id."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, cli_env

pytestmark = pytest.mark.slow

TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.max_seq_len=32", "data.tokenizer_vocab_size=512", "data.tokenizer_train_docs=3000",
    "data.num_streams=2", "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=6",
    "train.warmup_steps=2", "train.log_every=1", "train.val_every=3", "train.val_sequences=8",
    "checkpoint.every_steps=3", "cluster.num_workers=2", "model.dropout=0.1",
]


def _cli(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([PYTHON, "-m", "pretrain", *args], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _run_id(stdout: str) -> str:
    for line in stdout.splitlines():
        if line.strip().startswith("MLflow run id"):
            return line.split()[-1]
    raise AssertionError(f"no run id in output:\n{stdout[-2000:]}")


def _losses(tmp_path: Path, run_id: str) -> dict[int, float]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}  # the last logged value per step wins


def test_train_resume_exact_and_kill_resume(tmp_path):
    config = str(ROOT / "configs" / "demo-decoder.yaml")
    ref = _cli(tmp_path, "train", config, *TINY)
    assert "2 worker(s)" in ref.stdout and "unigram baseline" in ref.stdout
    ref_id = _run_id(ref.stdout)
    ref_losses = _losses(tmp_path, ref_id)
    assert sorted(ref_losses) == [1, 2, 3, 4, 5, 6]
    run_dir = tmp_path / "checkpoints" / ref_id
    assert (run_dir / "step_00000003" / "manifest.json").is_file()
    assert (run_dir / "step_00000006" / "manifest.json").is_file()

    # 1) Resume from the step-3 checkpoint directory: steps 4..6 are bitwise identical.
    forked = _cli(tmp_path, "resume", str(run_dir / "step_00000003"))
    fork_losses = _losses(tmp_path, _run_id(forked.stdout))
    print("\nreference:", ref_losses, "\nresumed:  ", fork_losses)
    assert sorted(fork_losses) == [4, 5, 6]
    assert all(fork_losses[s] == ref_losses[s] for s in (4, 5, 6))

    # 2) Kill a running job (SIGKILL to the driver and its embedded Ray) after its first commit,
    #    then `resume RUN_ID` continues from the last committed checkpoint of that run.
    proc = subprocess.Popen([PYTHON, "-m", "pretrain", "train", config, *TINY, "train.max_steps=6"],
                            cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run_id = None
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("[pretrain] run "):
            run_id = line.split()[2].rstrip(":")
        if run_id and (tmp_path / "checkpoints" / run_id / "step_00000003" / "manifest.json").is_file():
            break
    assert run_id and proc.poll() is None, "job ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    resumed = _cli(tmp_path, "resume", run_id)
    assert "resumed from" in resumed.stdout and run_id in resumed.stdout
    killed_losses = _losses(tmp_path, run_id)
    assert all(killed_losses[s] == ref_losses[s] for s in range(1, 7)), (killed_losses, ref_losses)

    listing = _cli(tmp_path, "runs").stdout
    assert ref_id in listing and run_id in listing
    detail = _cli(tmp_path, "runs", run_id).stdout
    assert "step_00000006" in detail and "step_00000003" in detail


def test_bad_records_fail_policy_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = '{"text": "A perfectly fine sentence about the weather and the sea."}\n'
    bad.write_text(good * 50 + '{"text": "unterminated\n' + good * 5)
    proc = subprocess.run([PYTHON, "-m", "pretrain", "train", *TINY, f"data.sources=[{{path: {bad}}}]",
                           "data.bad_records=fail", "cluster.use_ray=false"],
                          cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert err and f"{bad}:51" in err[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
