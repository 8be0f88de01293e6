"""The user's cache of this project: what is costly to make and fixed by what it is made from.

The root is ``$PRETRAIN_CACHE``, else ``$XDG_CACHE_HOME/pretrain``, else ``~/.cache/pretrain``. Trained tokenizers
(:mod:`pretrain.data.tokenizer_cache`) and MLflow's empty store (:mod:`pretrain.train.mlflow_store`) live there, and
small values (:func:`read_value`, :func:`write_value`): the unigram baseline of a run's data
(:mod:`pretrain.data.baseline`) and the measured matmul peak of a CPU (:mod:`pretrain.model.peak`).

A value is a JSON file ``<root>/<kind>/<key>.json`` holding its spec (everything the value depends on) beside the
value; the key is a hash of the spec and a read compares the whole spec, so a value is only ever returned for exactly
what it was computed from. Writes are atomic (a temporary file renamed into place); a cache that cannot be read or
written is a miss, never an error: the caller computes the value. ``PRETRAIN_VALUE_CACHE=0`` turns the value cache
off (every value is computed).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """The user's cache directory of this project (``$PRETRAIN_CACHE``, ``$XDG_CACHE_HOME/pretrain``, or
    ``~/.cache/pretrain``)."""
    if os.environ.get("PRETRAIN_CACHE"):
        return Path(os.environ["PRETRAIN_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "pretrain"


def values_enabled() -> bool:
    """Whether :func:`read_value` may answer (``PRETRAIN_VALUE_CACHE`` unset or not 0/false/no/off)."""
    return os.environ.get("PRETRAIN_VALUE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _canonical(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def value_path(kind: str, spec: dict) -> Path:
    """The file of the value of ``kind`` (a folder name) computed from ``spec`` (JSON-serializable)."""
    key = hashlib.sha256(_canonical(spec).encode()).hexdigest()[:32]
    return cache_root() / kind / f"{key}.json"


def read_value(kind: str, spec: dict) -> Any | None:
    """The cached value of ``kind`` for exactly ``spec``, or None (a miss, a damaged file, the cache off)."""
    if not values_enabled():
        return None
    try:
        entry = json.loads(value_path(kind, spec).read_text())
        if _canonical(entry["spec"]) != _canonical(spec):
            return None
        return entry["value"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_value(kind: str, spec: dict, value: Any) -> bool:
    """Store ``value`` (JSON-serializable) as the value of ``kind`` for ``spec``, atomically; False when the cache
    cannot be written (the caller goes on: the cache is an optimisation)."""
    path = value_path(kind, spec)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"spec": spec, "value": value}, f, sort_keys=True)
        os.replace(tmp, path)
        tmp = None
        return True
    except (OSError, TypeError, ValueError):
        return False
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
