"""Shared fixtures. Every test runs offline, with telemetry off and its own MLflow store."""

from __future__ import annotations

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


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory with its own sqlite MLflow store."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env["PYTHONPATH"] = str(ROOT)
    return env


PYTHON = sys.executable
