"""A new local MLflow store starts from MLflow's own empty store, made once per MLflow version.

MLflow creates a sqlite tracking store by running its whole chain of schema migrations (about 70 Alembic
revisions: seconds of a command's start-up, on every new store — the first run on a machine, every test's store).
The result is the same file every time, but for its default experiment, whose artifact location is the store's own.
So the first time, an empty store is made by MLflow itself in the user's cache (``<cache root>/mlflow/``, keyed by
the MLflow version), without its default experiment; a store that does not exist yet is then created as a copy of
it, and MLflow adds the default experiment when it opens the copy, as it would in a store it made. An existing file
is never touched; where the copy cannot be made (no hard links, a read-only cache), MLflow makes the store itself.
Also how a store's URI is read (:func:`sqlite_path`) and printed (:func:`shown_uri`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pretrain.user_cache import cache_root


def sqlite_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` tracking URI (relative to the working directory, or absolute with four
    slashes); None for any other store, an in-memory database, or a URI with query options."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or "?" in uri:
        return None
    name = uri[len(prefix) :]
    return None if name in ("", ":memory:") else Path(name)


def shown_uri(uri: str) -> str:
    """``uri`` as it may be printed: a password in it (``http://user:PASSWORD@host``) or a userinfo with no password
    (``https://TOKEN@host``) replaced by ``***`` and any query (tokens) left out; MLflow's own
    ``MLFLOW_TRACKING_USERNAME`` / ``_PASSWORD`` keep credentials out of it."""
    parts = urlsplit(uri)
    if not parts.netloc or ("@" not in parts.netloc and not parts.query):
        return uri
    user, at, host = parts.netloc.rpartition("@")
    netloc = (f"{user.split(':', 1)[0]}:***@{host}" if ":" in user else f"***@{host}") if at else parts.netloc
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def template_path() -> Path:
    return cache_root() / "mlflow" / f"empty-store-mlflow-{version('mlflow')}.db"


def make_template(path: Path) -> None:
    """An empty store made by MLflow (every migration run), its default experiment removed; atomic."""
    from mlflow import MlflowClient

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        store = MlflowClient(tracking_uri=f"sqlite:///{tmp.resolve()}")._tracking_client.store
        store.engine.dispose()
        with contextlib.closing(sqlite3.connect(tmp)) as db, db:
            db.execute("DELETE FROM experiments")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def seed_store(uri: str) -> bool:
    """Create the sqlite store of ``uri`` as a copy of MLflow's empty store when the file does not exist yet (its
    directory does); True when this call created it."""
    path = sqlite_path(uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return False
    template = template_path()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.seed")
    try:
        if not template.is_file():
            try:
                make_template(template)
            except Exception:  # noqa: BLE001  (MLflow's own errors surface when it makes the store itself)
                return False
        shutil.copyfile(template, tmp)
        os.link(tmp, path)  # never over a store that another process created meanwhile
        return True
    except OSError:  # a store created meanwhile, no hard links, a read-only cache: MLflow makes the store
        return False
    finally:
        tmp.unlink(missing_ok=True)
