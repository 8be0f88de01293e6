"""Shared fixtures. Every test runs offline, with telemetry off and its own MLflow store."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("RAY_ADDRESS", None)
SHARED = ROOT.parent / "shared" / "corpora"


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory):
    """The user-level cache (trained tokenizers) of this session: never ~/.cache; the processes tests start
    inherit it. Entries are keyed by everything the tokenizer depends on, so a hit equals a fresh training and
    tests stay independent of their order."""
    old = os.environ.get("PRETRAIN_CACHE")
    os.environ["PRETRAIN_CACHE"] = str(tmp_path_factory.mktemp("user_cache"))
    yield Path(os.environ["PRETRAIN_CACHE"])
    if old is None:
        os.environ.pop("PRETRAIN_CACHE", None)
    else:
        os.environ["PRETRAIN_CACHE"] = old


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory with its own sqlite MLflow store."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


@contextlib.contextmanager
def in_workdir(work: Path):
    """Run in ``work`` with its own sqlite MLflow store (for module-scoped fixtures; ``workdir`` is per test)."""
    old_cwd, old_uri = os.getcwd(), os.environ.get("MLFLOW_TRACKING_URI")
    os.chdir(work)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    try:
        yield work
    finally:
        os.chdir(old_cwd)
        if old_uri is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = old_uri


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env["PYTHONPATH"] = str(ROOT)
    return env


PYTHON = sys.executable


@pytest.fixture(scope="module")
def datasets_cache(tmp_path_factory):
    """Keep the lock files that ``datasets`` builders create out of the user's cache."""
    import datasets

    old = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf_datasets")
    yield
    datasets.config.HF_DATASETS_CACHE = old


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted 2-worker Ray run (8 steps, checkpoints every 2) that the e2e and multi-node
    tests reproduce (resumed, killed, elastic, spread over nodes)."""
    work = tmp_path_factory.mktemp("e2e")
    from tests.test_train_e2e import CONFIG, TASKS, TINY, _cli, _losses, _run_id

    # with a downstream task (scored on both ranks at validation): the runs that reproduce it have none, so their
    # equal losses also show that task evaluation leaves training untouched
    proc = _cli(work, "train", CONFIG, *TINY, *TASKS)
    assert "2 worker(s)" in proc.stdout and "unigram baseline" in proc.stdout
    run_id = _run_id(proc.stdout)
    losses = _losses(work, run_id)
    assert sorted(losses) == list(range(1, 9))
    run_dir = work / "checkpoints" / run_id
    assert [p.name for p in sorted(run_dir.glob("step_*"))] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    return {"work": work, "run_id": run_id, "losses": losses, "run_dir": run_dir}
