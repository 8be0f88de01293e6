"""Help where users look: every command answers ``--help`` and ``-h`` with its usage on stdout, exit 0 and nothing
done; the top-level help lists every command and every bench mode; ``runs`` shows whole run names and the tokens
of derived runs; the MLflow experiment is a model-training one (``mlflow.experimentKind``). Bare ``./launch.sh`` and
a real train/prune/grow through the command line: ``tests/integration/cli/test_help.py``."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.cli import __doc__ as BENCH_DOC
from pretrain.checkpoint import Manifest, layout
from pretrain.cli import COMMANDS, main
from pretrain.train import tracking
from pretrain.train.mlflow_records import mlflow_client

BENCH_MODES = re.findall(r"^``(--[a-z-]+)``", BENCH_DOC or "", re.M)


def test_the_bench_modes_are_read_from_the_bench_table():
    assert set(BENCH_MODES) >= {"--layer-drop", "--vs-hf", "--growth", "--recompute", "--checkpoint", "--cluster"}


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_every_command_answers_help_and_does_nothing(cmd, flag, workdir, capsys):
    """Exit 0, its usage (naming the command) on stdout, nothing on stderr, nothing created in the working
    directory (no MLflow store, no checkpoints): also for the commands whose first argument is a run or a config."""
    assert main([cmd, flag]) == 0
    out, err = capsys.readouterr()
    assert f"usage: launch.sh {cmd}" in out, out
    assert err == ""
    assert sorted(p.name for p in workdir.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["ui", "--bogus"],
        ["tokenize", "--bogus"],
        ["jobs", "--bogus"],
        ["status"],
        ["logs", "--bogus"],
        ["stop"],
        ["cluster", "sideways"],
        ["bench", "--bogus"],
        ["bench", "--gpu", "--steps", "x"],
        ["bench", "--build-corpus", "--vocab", "x"],
        ["export"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_a_bad_argument_is_one_line_and_exit_2(argv, workdir, capsys):
    """argparse's own error prints its usage over several lines: every command's bad argument is one line."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: launch.sh {argv[0]}") and err.count("\n") == 1, err


def test_train_help_names_the_config_the_overrides_and_dry_run(workdir, capsys):
    assert main(["train", "configs/demo-encoder.yaml", "train.max_steps=3", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: launch.sh train [CONFIG.yaml] [key.sub=value ...] [--dry-run]")
    assert "data.sources[0].text_field=content" in out and "--dry-run:" in out


def test_bench_help_lists_every_mode(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    modes = out.split("modes (")[1]
    for mode in BENCH_MODES:
        assert re.search(rf"^  {re.escape(mode)} ", modes, re.M), mode


@pytest.mark.parametrize("argv", [[], ["--help"], ["-h"], ["help"]])
def test_top_level_help_lists_every_command_and_bench_mode(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    for cmd in COMMANDS:
        assert re.search(rf"^    {cmd} ", out, re.M), cmd
    for mode in BENCH_MODES:
        assert re.search(rf"^    bench .*{re.escape(mode)}\b", out, re.M), mode
    assert "CMD --help (or -h)" in out


# -- runs: whole names, tokens of derived runs ------------------------------------------------------------------


def _checkpoint(root, step: int, tokens: int, metrics: dict | None = None):
    """A committed checkpoint as ``runs`` reads it: its manifest."""
    path = root / layout.step_dir_name(step)
    path.mkdir(parents=True)
    manifest = Manifest(step=step, tokens_seen=tokens, metrics=metrics or {})
    (path / layout.MANIFEST).write_text(json.dumps(manifest.to_dict()))
    return path


def test_runs_shows_whole_names_and_the_tokens_of_derived_runs(workdir, capsys):
    """A parent that logged ``train/tokens_seen``; a pruned and a grown child (derived: no metric, a checkpoint whose
    manifest counts the parent's tokens); a run with neither: ``-``; a run killed after its checkpoint: the
    checkpoint's tokens and val loss, not those of the steps it lost. Names longer than 16 characters are whole."""
    uri = tracking.tracking_uri()
    client = mlflow_client(uri)
    exp = tracking.get_or_create_experiment(uri, "pretrain")
    parent = client.create_run(exp, run_name="demo-decoder-with-a-long-name").info.run_id
    client.log_metric(parent, "train/tokens_seen", 409_600, step=200)
    names = {"prune": "demo-decoder-with-a-long-name-pruned2", "growth": "demo-decoder-with-a-long-name-grown"}
    for what, name in names.items():
        ckpt = _checkpoint(workdir / "checkpoints" / what, 200, 409_600)
        tags = {"pretrain.derived": what, "mlflow.parentRunId": parent, tracking.TAG_CKPT_LATEST: str(ckpt)}
        client.create_run(exp, run_name=name, tags={**tags, tracking.TAG_CKPT_STEP: "200"})
    client.create_run(exp, run_name="nothing-yet")
    # Killed at step 190 after its checkpoint at 100: the listing is the checkpoint's, not the lost steps'.
    ckpt = _checkpoint(workdir / "checkpoints" / "killed", 100, 204_800, {"val/loss": 4.25})
    killed = client.create_run(exp, run_name="killed", tags={tracking.TAG_CKPT_LATEST: str(ckpt)}).info.run_id
    client.set_tag(killed, tracking.TAG_CKPT_STEP, "100")
    client.log_metric(killed, "train/tokens_seen", 389_120, step=190)
    client.log_metric(killed, "val/loss", 3.5, step=190)

    assert main(["runs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[1], {line.split()[1]: line for line in lines[2:] if not line.lstrip().startswith("^")}
    assert sorted(rows) == sorted([*names.values(), "demo-decoder-with-a-long-name", "nothing-yet", "killed"]), lines
    assert re.search(r" killed +RUNNING +100 +204,800 +4\.2500 ", rows["killed"]), rows["killed"]
    for name in [*names.values(), "demo-decoder-with-a-long-name"]:
        assert re.search(rf" {re.escape(name)} +RUNNING +\S+ +409,600 ", rows[name]), rows[name]
    assert re.search(r" nothing-yet +RUNNING +- +- ", rows["nothing-yet"]), rows["nothing-yet"]
    assert all(row.index(" RUNNING ") + 1 == header.index("status") for row in rows.values())  # aligned columns


# -- MLflow: a model-training experiment ----------------------------------------------------------------------


def test_the_experiment_is_a_model_training_one(tmp_path):
    """A new experiment is created with the kind MLflow 3's UI reads (without it the UI shows a GenAI experiment);
    an experiment made before gets it when used; ``mark_training_experiments`` (``./launch.sh ui``) tags the
    experiments holding runs of ours, and leaves other experiments and a kind already set alone."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow_client(uri)
    kind = lambda exp_id: client.get_experiment(exp_id).tags.get("mlflow.experimentKind")  # noqa: E731

    new = tracking.get_or_create_experiment(uri, "pretrain")
    assert kind(new) == "custom_model_development"
    old = client.create_experiment("made-before", artifact_location=(tmp_path / "a").as_uri())
    assert kind(old) is None
    assert tracking.get_or_create_experiment(uri, "made-before") == old and kind(old) == "custom_model_development"

    ours = client.create_experiment("ours-unmarked", artifact_location=(tmp_path / "b").as_uri())
    client.create_run(ours, tags={tracking.TAG_KIND: "decoder"})
    other = client.create_experiment("someone-else", artifact_location=(tmp_path / "c").as_uri())
    client.create_run(other)
    genai = client.create_experiment("genai", artifact_location=(tmp_path / "d").as_uri())
    client.set_experiment_tag(genai, "mlflow.experimentKind", "genai_development")
    client.create_run(genai, tags={tracking.TAG_KIND: "decoder"})
    assert tracking.mark_training_experiments(uri) == 1
    assert kind(ours) == "custom_model_development" and kind(other) is None and kind(genai) == "genai_development"


@pytest.mark.parametrize("args", [["anneal", "--help"], ["--help"], ["runs", "-h"]])
def test_help_into_a_pipe_nobody_reads_ends_quietly(args):
    """``python -m pretrain anneal --help | head -2``: a reader gone before the help is written ends the command with
    SIGPIPE's status and nothing on stderr (no BrokenPipeError traceback), as a command's output does."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # no reader at all: the first write fails, whatever the timing
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pretrain", *args], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, "")
