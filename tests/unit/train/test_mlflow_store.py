"""A new local MLflow store starts as a copy of MLflow's own empty store: the same schema and revision as a store
MLflow makes, its default experiment its own, and never a file the user already has."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from mlflow import MlflowClient

from pretrain.train.mlflow_store import seed_store, sqlite_path, template_path


@pytest.mark.parametrize(
    "uri, want",
    [
        ("sqlite:///mlflow.db", Path("mlflow.db")),
        ("sqlite:////abs/dir/m.db", Path("/abs/dir/m.db")),
        ("sqlite:///:memory:", None),
        ("sqlite:///m.db?timeout=20", None),
        ("file:///tmp/mlruns", None),
        ("http://127.0.0.1:5000", None),
        ("databricks", None),
    ],
)
def test_sqlite_path(uri, want):
    assert sqlite_path(uri) == want


def schema(path: Path) -> list[tuple]:
    """Every table and index: its kind, name and the clauses of its SQL as a set (MLflow's batch migrations order
    a table's constraints differently from one store to the next)."""
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT type, name, sql FROM sqlite_master").fetchall()
    clauses = lambda sql: tuple(sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))  # noqa: E731
    return sorted((kind, name, clauses(sql)) for kind, name, sql in rows)


def test_a_seeded_store_is_the_store_mlflow_makes(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made, seeded = tmp_path / "made.db", tmp_path / "seeded.db"
    MlflowClient(f"sqlite:///{made}").search_experiments()  # MLflow's own: every migration run
    assert seed_store(f"sqlite:///{seeded}") and template_path().is_file()
    client = MlflowClient(f"sqlite:///{seeded}")
    (default,) = client.search_experiments()
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    assert schema(seeded) == schema(made)
    with sqlite3.connect(seeded) as a, sqlite3.connect(made) as b:
        assert (
            a.execute("SELECT * FROM alembic_version").fetchall()
            == b.execute("SELECT * FROM alembic_version").fetchall()
        )
    run = client.create_run(client.create_experiment("x"))
    client.log_metric(run.info.run_id, "loss", 1.5, step=1)
    assert client.get_metric_history(run.info.run_id, "loss")[0].value == 1.5

    # the template is made once; an existing file is never touched; a missing directory is MLflow's to report
    stamp = template_path().stat().st_mtime_ns
    assert seed_store(f"sqlite:///{tmp_path / 'again.db'}") and template_path().stat().st_mtime_ns == stamp
    mine = tmp_path / "mine.db"
    mine.write_bytes(b"not a database")
    assert not seed_store(f"sqlite:///{mine}") and mine.read_bytes() == b"not a database"
    assert not seed_store(f"sqlite:///{tmp_path / 'missing' / 'm.db'}")
    assert not (tmp_path / "missing").exists()
    assert not list(tmp_path.glob(".*.seed")), "no leftover copy"
