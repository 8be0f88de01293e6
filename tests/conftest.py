"""Shared fixtures of unit and integration tests. Every test runs offline, with telemetry off and its own MLflow
store."""

from __future__ import annotations

import contextlib
import os
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
# Printed commands as a user sees them who runs ./launch.sh from the checkout, however pytest was started
# (tests/unit/test_invocation.py covers the other ways to start a command).
os.environ["PRETRAIN_LAUNCHER"] = "./launch.sh"
SHARED = ROOT.parent / "shared" / "corpora"
WIKITEXT = SHARED / "wikitext2-valid.txt"
FIXTURES = ROOT / "tests" / "fixtures"  # files kept byte for byte (a checkpoint written by an older version)

from tests.empty_store import empty_store  # noqa: E402  (after the environment above)
from tests.harness import PYTHON, cli_env, close_pools  # noqa: E402, F401  (after the environment above; re-exported)

LONGEST_FIRST = (
    "integration/train/test_train_e2e.py",
    "integration/growth/test_growth.py",
    "integration/parallel/test_model_parallel.py",
    "integration/train/test_golden.py",
    "integration/cluster/test_cluster.py",
    "integration/cli/test_help.py",
    "integration/train/test_lifecycle.py",
    "integration/growth/test_layer_drop.py",
    "integration/data/test_token_shards.py",
    "integration/parallel/test_moe.py",
    "integration/train/test_stop.py",
    "integration/cluster/test_multinode.py",
    "integration/bench/test_checkpoint.py",
    "integration/bench/test_studies.py",
    "integration/bench/test_gpu_check.py",
)
"""The test files that take longest (over a minute each, two at a time on 2 cores), in that order. Under
pytest-xdist (``./launch.sh test``: ``-n 2 --dist loadfile --no-loadscope-reorder``, whole files to each worker in
collection order) they are handed out first, then the other integration files, then the unit tests (seconds each),
so that the workers end together instead of one finishing a long file alone. Only the balance depends on this list,
never a result."""


@pytest.hookimpl(trylast=True)  # after the integration conftest has marked its tests
def pytest_collection_modifyitems(items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def rank(item) -> tuple[int, int]:
        rel = Path(item.path).resolve().relative_to(ROOT / "tests").as_posix()
        return (0, first[rel]) if rel in first else (2, 0) if rel.startswith("unit/") else (1, 0)

    items.sort(key=rank)  # stable: each file's tests stay together and in order


def pytest_sessionfinish(session, exitstatus):
    close_pools()


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
    """A fresh, empty working directory with its own sqlite MLflow store (made by whatever opens it first)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A user-level cache of this test's own (``PRETRAIN_CACHE`` in ``tmp_path``), empty at the start."""
    root = tmp_path / "user-cache"
    monkeypatch.setenv("PRETRAIN_CACHE", str(root))
    monkeypatch.delenv("PRETRAIN_TOKENIZER_CACHE", raising=False)
    return root


@contextlib.contextmanager
def in_workdir(work: Path):
    """Run in ``work`` with its own sqlite MLflow store (for module-scoped fixtures; ``workdir`` is per test)."""
    empty_store(work)
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


@pytest.fixture(scope="module")
def datasets_cache(tmp_path_factory):
    """Keep the lock files that ``datasets`` builders create out of the user's cache."""
    import datasets

    old = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf_datasets")
    yield
    datasets.config.HF_DATASETS_CACHE = old


def corpus_lines(limit: int = 3000) -> list[str]:
    """wikitext-2 validation lines when available, else a synthetic multilingual corpus."""
    if WIKITEXT.is_file():
        return [line for line in WIKITEXT.read_text(encoding="utf-8").splitlines() if line.strip()][:limit]
    words = ["the", "model", "über", "naïve", "日本", "data", "token", "résumé", "π", "city", "river", "1999"]
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(5 + i % 9)) for i in range(limit)]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE trained like training does (``pretrain.data.tokenizer``), saved once."""
    from pretrain.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(corpus_lines(1500), 500).save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
