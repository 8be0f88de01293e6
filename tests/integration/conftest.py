"""Integration tests: several processes (real gloo through ``run_distributed``, real Ray, the command line in a
subprocess). Every test here is marked ``slow``: ``-m "not slow"`` selects exactly ``tests/unit``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import CONFIG, E2E, TASKS, cli, metric_history, run_id_of

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker, and before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    ours = [item for item in items if HERE in Path(item.path).resolve().parents]
    shared = {item.path for item in ours if "reference" in getattr(item, "fixturenames", ())}
    for item in ours:
        item.add_marker(pytest.mark.slow)
        # ``./launch.sh test`` runs these files two at a time (``--dist loadgroup``): each file on one worker, and
        # the files that read the session's ``reference`` run on the same one, so no shared run is made twice.
        group = "reference" if item.path in shared else Path(item.path).relative_to(HERE).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One uninterrupted 2-worker Ray run (8 steps, checkpoints every 2) that the end-to-end and multi-node tests
    reproduce (resumed, killed, elastic, spread over nodes)."""
    work = tmp_path_factory.mktemp("e2e")
    # with a downstream task (scored on both ranks at validation): the runs that reproduce it have none, so their
    # equal losses also show that task evaluation leaves training untouched
    proc = cli(work, "train", CONFIG, *E2E, *TASKS, "stability.plot_at_end=true")
    assert "2 worker(s)" in proc.stdout and "unigram baseline" in proc.stdout
    run_id = run_id_of(proc.stdout)
    plot = work / "checkpoints" / run_id / "training.png"
    assert f"training plot: {plot}" in proc.stdout and plot.read_bytes().startswith(b"\x89PNG")
    losses = metric_history(run_id, uri=f"sqlite:///{work / 'mlflow.db'}")
    assert sorted(losses) == list(range(1, 9))
    run_dir = work / "checkpoints" / run_id
    assert [p.name for p in sorted(run_dir.glob("step_*"))] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    return {"work": work, "run_id": run_id, "losses": losses, "run_dir": run_dir}
