"""Help where users look, as users run it: a bare ``./launch.sh`` (and ``help``, ``-h``, ``--help``) prints the usage
and exits 0 instead of training; a trained run and its pruned and grown children show in ``runs`` with whole names
and their tokens, in an experiment MLflow's UI opens as model training: every link the commands print carries
``workflowType=machine_learning``, and a real ``./launch.sh ui`` shows those pages in headless Chromium as the Runs
table and the run's Model metrics, not the GenAI overview. The in-process checks: ``tests/unit/house/
test_cli_help.py``, ``tests/unit/driver/test_ui_links.py``."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from pretrain.cli import COMMANDS
from pretrain.ports import free_port
from tests import browser
from tests.conftest import PYTHON, ROOT, cli_env
from tests.harness import CONFIG, cli, run_id_of, session_processes, start_cli, tiny_model

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
        env=cli_env(tmp_path, store=False),
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


@pytest.mark.parametrize("own", ["setup", "wheelhouse", "lock", "lint", "test"])
def test_the_launchers_own_commands_print_their_usage_for_help_and_do_nothing_else(own, tmp_path):
    """``./launch.sh CMD --help`` of a command of the launcher itself (no setup, no lint, no lock re-resolved, no
    pytest): its lines of the launcher's usage, exit 0; ``-h`` anywhere among the arguments the same."""
    for args in (["--help"], ["x", "-h"]):
        proc = subprocess.run(
            ["bash", str(ROOT / "launch.sh"), own, *args],
            cwd=tmp_path,
            env={**cli_env(tmp_path, store=False), "PATH": "/usr/bin:/bin"},  # no uv, no python: nothing may run
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert re.match(rf"^ \./launch\.sh {own} ", proc.stdout), proc.stdout
    assert list(tmp_path.iterdir()) == []


@dataclass
class Lineage:
    """A trained run and its pruned and grown children in one working directory, with what each command printed."""

    work: Path
    name: str
    parent: str
    out: dict[str, str]

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=f"sqlite:///{self.work / 'mlflow.db'}")


@pytest.fixture(scope="module")
def lineage(tmp_path_factory) -> Lineage:
    work = tmp_path_factory.mktemp("lineage")
    name = "a-name-longer-than-sixteen"
    train = cli(work, "train", CONFIG, *TINY, f"name={name}").stdout
    parent = run_id_of(train)
    prune = cli(work, "prune", parent, "layers=first:1").stdout
    grow = cli(work, "grow", parent, "depth=2x", "noise=0").stdout
    return Lineage(work, name, parent, {"train": train, "prune": prune, "grow": grow})


def test_runs_shows_trained_pruned_and_grown_runs_whole_with_their_tokens(lineage):
    """Train 2 steps (2 x 8 x 32 = 512 tokens), prune and grow its checkpoint: ``runs`` lists the three by their
    whole names (the 16-character cut made children of a long name look alike) and 512 tokens each (a derived run
    logs no train/tokens_seen: its checkpoint's count, the parent's included); the experiment carries MLflow's
    model-training kind."""
    name = lineage.name
    out = cli(lineage.work, "runs").stdout
    rows = {line.split()[1]: line for line in out.splitlines()[2:] if not line.lstrip().startswith("^")}
    assert sorted(rows) == sorted([name, f"{name}-pruned1", f"{name}-grown"]), out
    for row in rows.values():
        assert re.search(r" FINISHED +2 +512 ", row), row
    client = lineage.client()
    exp = client.get_experiment(client.get_run(lineage.parent).info.experiment_id)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"


ML = "?workflowType=machine_learning"


def test_every_printed_link_opens_the_run_as_model_training(lineage):
    """The summary of ``train``, the lines of ``prune`` and ``grow`` and ``runs RUN`` name the run's page at the
    default address of ``./launch.sh ui``, in the run's experiment, with the model-training workflow."""
    client = lineage.client()
    exp = client.get_run(lineage.parent).info.experiment_id
    page = f"http://127.0.0.1:5000/#/experiments/{exp}/runs"
    assert f"\n  run in UI:   {page}/{lineage.parent}{ML}\n" in lineage.out["train"], lineage.out["train"]
    for what in ("prune", "grow"):
        child = re.search(rf"^\[{what}\] new run (\w+)", lineage.out[what], re.M)
        assert child, lineage.out[what]
        assert client.get_run(child[1]).info.experiment_id == exp
        assert f"\n  MLflow:  {page}/{child[1]}{ML}\n" in lineage.out[what], lineage.out[what]
    runs = cli(lineage.work, "runs", lineage.parent).stdout.splitlines()
    assert runs[1] == f"  in the UI: {page}/{lineage.parent}{ML}", runs


def _page_shows(url: str, *texts: str, absent: tuple[str, ...] = (), tab: browser.Tab | None = None) -> list[str]:
    """The lines of the page (in ``tab``, else a browser of its own) once ``texts`` are there; none of ``absent``
    among them."""
    lines = browser.page_lines(url, texts, tab=tab)
    missing = [t for t in texts if t not in lines]
    present = [t for t in absent if t in lines]
    assert not missing and not present, f"{url}: missing {missing}, present {present}: {lines[:60]}"
    return lines


def test_the_ui_opens_on_training_in_a_browser(lineage, tmp_path):
    """``./launch.sh ui --open`` on a free port prints the experiment's link and opens it in ``$BROWSER`` (a script
    that records it) once the UI answers. Chromium, with a fresh profile as a new user has, shows that link as the
    Runs table with the run (its children nested under it), then the run's link as its page with Model metrics;
    both with the model-training side bar (Runs, Models, Model registry) and none of the GenAI one (Judges,
    Evaluation runs). The same experiment without the parameter is the GenAI overview, which is what this test
    guards against. The store's URI (which may hold a password) is on no process's command line. The run's charts
    are screenshot (``PRETRAIN_UI_SCREENSHOT=PATH``: there)."""
    browser.require_chromium()
    opened, script = tmp_path / "opened.txt", tmp_path / "browser.sh"
    script.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    port = free_port()
    log = tmp_path / "ui.log"
    env = {**cli_env(lineage.work), "BROWSER": str(script)}
    with log.open("w") as sink:
        ui = start_cli(
            lineage.work,
            "ui",
            "--port",
            str(port),
            "--open",
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not _answers(base):
            assert ui.poll() is None and time.monotonic() < deadline, f"ui did not come up:\n{log.read_text()[-3000:]}"
            time.sleep(1)
        served = [" ".join(p["cmdline"] or []) for p in session_processes(ui.pid)]
        assert not [c for c in served if "huey" in c or "job_runner" in c], served  # no GenAI job runner
        assert not [c for c in served if "mlflow.db" in c], served  # the store's URI is in no command line (ps)
        client = lineage.client()
        exp = client.get_run(lineage.parent).info.experiment_id
        exp_url = f"{base}/#/experiments/{exp}{ML}"
        assert f"[pretrain] experiment pretrain: {exp_url}\n" in log.read_text(), log.read_text()
        while not (opened.is_file() and opened.read_text().strip()):
            assert time.monotonic() < deadline, "ui --open did not open the browser"
            time.sleep(0.5)
        assert opened.read_text().strip() == exp_url

        genai = ("Judges", "Evaluation runs", "Agent versions")
        training = ("Runs", "Models", "Model registry")
        with browser.Tab(*browser.SHOT) as tab:  # a new user's browser, following the links one after another
            lines = _page_shows(exp_url, *training, lineage.name, absent=genai, tab=tab)
            assert re.search(r"\b3\s+matching runs", "\n".join(lines)), lines  # the children nested under their parent
            run_url = f"{base}/#/experiments/{exp}/runs/{lineage.parent}{ML}"
            _page_shows(run_url, *training, "Model metrics", lineage.name, absent=(*genai, "Evaluations"), tab=tab)
            charts = f"{base}/#/experiments/{exp}/runs/{lineage.parent}/model-metrics{ML}"
            out = Path(os.environ.get("PRETRAIN_UI_SCREENSHOT") or tmp_path / "charts.png")
            shot = browser.screenshot(charts, out, tab=tab)
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 20_000 < shot.stat().st_size < 300_000
        _page_shows(exp_url.removesuffix(ML), *genai, absent=("Model registry",))  # a link without it, a fresh profile
    finally:
        os.killpg(ui.pid, signal.SIGTERM)  # the UI's own session: mlflow, its server and job runner
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
            ui.wait()


def _answers(base: str) -> bool:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False
