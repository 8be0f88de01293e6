"""A test's MLflow store, ready-made: ``empty_store(work)`` puts a copy of a migrated, empty sqlite store at
``work/mlflow.db`` when none is there.

Every new sqlite store runs MLflow's schema migrations when it is first opened (about a CPU-second, in whichever
process opens it first); copying a store migrated once per test process skips them. The copy is the store MLflow
makes (its tables and the Default experiment), so a command that opens it behaves as on a store it created. A test
that checks whether a command creates a store at all uses a directory without one (``cli(..., store=False)``), and
the tests that leave ``MLFLOW_TRACKING_URI`` unset still see MLflow create one.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["empty_store"]


def empty_store(work: Path) -> Path:
    """``work/mlflow.db``: a copy of the migrated empty store unless a file is there already (never overwritten)."""
    db = Path(work) / "mlflow.db"
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        partial = db.with_name(f".mlflow.db.{os.getpid()}.partial")
        shutil.copyfile(_template(), partial)
        partial.replace(db)
    return db


@functools.cache
def _template() -> Path:
    """The migrated empty store of this process, made on first use (its directory removed at exit)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = Path(tempfile.mkdtemp(prefix="pretrain-empty-store-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    db = root / "mlflow.db"
    store = SqlAlchemyStore(f"sqlite:///{db}", (root / "mlruns").as_uri())
    store.engine.dispose()
    return db
