"""Help where users look, as users run it: a bare ``./launch.sh`` (and ``help``, ``-h``, ``--help``) prints the usage
and exits 0 instead of training; a trained run and its pruned and grown children show in ``runs`` with whole names
and their tokens, in an experiment MLflow's UI opens as model training. The in-process checks:
``tests/unit/house/test_cli_help.py``."""

from __future__ import annotations

import re
import subprocess

import pytest

from pretrain.cli import COMMANDS
from tests.conftest import PYTHON, ROOT, cli_env
from tests.harness import CONFIG, cli, run_id_of, tiny_model

TINY = [
    *tiny_model(num_kv_heads=2, max_seq_len=32, vocab_size=None),
    "data.tokenizer_vocab_size=300",
    "data.tokenizer_train_docs=1000",
    "data.num_streams=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.max_steps=2",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_sequences=8",
    "checkpoint.every_steps=2",
    "cluster.num_workers=1",
    "train.num_threads=1",
]
"""A run of two steps in the command's own process (one worker)."""


@pytest.mark.parametrize("args", [[], ["help"]], ids=["bare", "help"])  # -h and --help: the same case of launch.sh
def test_launch_sh_without_a_command_prints_the_usage(args, tmp_path):
    """``python -m pretrain --help`` (every command) and launch.sh's own commands, exit 0, nothing started: no MLflow
    store, no checkpoints in the working directory. (launch.sh runs its setup first: a no-op on a current venv.)"""
    stamp = ROOT / ".venv" / ".pretrain-setup"
    if not stamp.is_file() or PYTHON != str(ROOT / ".venv" / "bin" / "python"):
        pytest.skip("this venv was not made by ./launch.sh setup, which would install one first")
    proc = subprocess.run(
        ["bash", str(ROOT / "launch.sh"), *args],
        cwd=tmp_path,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for cmd in COMMANDS:
        assert re.search(rf"^    {cmd} ", proc.stdout, re.M), cmd
    for own in ("setup", "lock", "lint", "test [ARGS]", "[help]"):
        assert re.search(rf"^  \./launch\.sh {re.escape(own)} ", proc.stdout, re.M), own
    assert list(tmp_path.iterdir()) == []


def test_runs_shows_trained_pruned_and_grown_runs_whole_with_their_tokens(tmp_path):
    """Train 2 steps (2 x 8 x 32 = 512 tokens), prune and grow its checkpoint: ``runs`` lists the three by their
    whole names (the 16-character cut made children of a long name look alike) and 512 tokens each (a derived run
    logs no train/tokens_seen: its checkpoint's count, the parent's included); the experiment carries MLflow's
    model-training kind."""
    from mlflow import MlflowClient

    name = "a-name-longer-than-sixteen"
    parent = run_id_of(cli(tmp_path, "train", CONFIG, *TINY, f"name={name}").stdout)
    cli(tmp_path, "prune", parent, "layers=first:1")
    cli(tmp_path, "grow", parent, "depth=2x", "noise=0")
    out = cli(tmp_path, "runs").stdout
    rows = {line.split()[1]: line for line in out.splitlines()[2:] if not line.lstrip().startswith("^")}
    assert sorted(rows) == sorted([name, f"{name}-pruned1", f"{name}-grown"]), out
    for row in rows.values():
        assert re.search(r" FINISHED +2 +512 ", row), row
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment(client.get_run(parent).info.experiment_id)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
