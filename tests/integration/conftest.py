"""Integration tests: several processes (real gloo through ``run_distributed``, real Ray, the command line in a
subprocess). Every test here is marked ``slow``: ``-m "not slow"`` selects exactly ``tests/unit``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from filelock import FileLock

from tests.harness import CONFIG, E2E, TASKS, cli, metric_history, run_id_of

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted 2-worker Ray run (8 steps, checkpoints every 2) that the end-to-end and multi-node tests
    reproduce (resumed, killed, elastic, spread over nodes). Made once per test session: ``./launch.sh test`` runs
    these files two at a time (``-n 2 --dist loadfile``, a file's tests on one pytest-xdist worker), and the first
    worker to need the run makes it while the other waits for it (a file lock in the session's shared temporary
    directory)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _reference(tmp_path_factory.mktemp("e2e"))
    shared = tmp_path_factory.getbasetemp().parent  # the session's, above each worker's own
    made = shared / "reference.json"
    with FileLock(str(made) + ".lock"):
        if not made.is_file():
            ref = _reference(shared / "e2e")
            made.write_text(json.dumps({**ref, "work": str(ref["work"]), "run_dir": str(ref["run_dir"])}))
    ref = json.loads(made.read_text())
    losses = {int(step): loss for step, loss in ref["losses"].items()}
    return {**ref, "work": Path(ref["work"]), "run_dir": Path(ref["run_dir"]), "losses": losses}


def _reference(work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    # with a downstream task (scored on both ranks at validation): the runs that reproduce it have none, so their
    # equal losses also show that task evaluation leaves training untouched
    proc = cli(work, "train", CONFIG, *E2E, *TASKS, "stability.plot_at_end=true")
    assert "2 worker(s)" in proc.stdout and "unigram baseline" in proc.stdout
    run_id = run_id_of(proc.stdout)
    plot = work / "checkpoints" / run_id / "training.png"
    # the summary's row (the worker's own "training plot:" line is forwarded by Ray with no promise of arriving)
    assert f"training plot      {plot}" in proc.stdout and plot.read_bytes().startswith(b"\x89PNG")
    losses = metric_history(run_id, uri=f"sqlite:///{work / 'mlflow.db'}")
    assert sorted(losses) == list(range(1, 9))
    run_dir = work / "checkpoints" / run_id
    assert [p.name for p in sorted(run_dir.glob("step_*"))] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    return {"work": work, "run_id": run_id, "losses": losses, "run_dir": run_dir}
