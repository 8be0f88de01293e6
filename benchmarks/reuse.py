"""Reusing the runs of earlier studies (``bench --growth | --layer-drop --quality | --early-exit --reuse DIR``): a
study run whose config matches a finished run of an earlier study's MLflow store is read from that store instead of
trained again.

On CPU the same config and seed give bitwise-identical losses, so extending a study (another recipe, another seed)
need not repeat the runs it already has, and one study can read the runs another has in common with it (the
layer-dropout study's ``no-drop`` run is the growth study's ``scratch`` run on the same budget). A run matches when
every config value logged as its MLflow param equals this run's, except the keys that only say where things are
stored or how the run is named (:data:`LOCATION_KEYS`); ``data.tokenizer`` matches by the bytes of
``tokenizer.json``, not by its path. What the config cannot show (the code and the library versions that made the
run, and the machine's load while it was timed) is the user's to keep equal; the study's JSON names every reused run
and its store."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

LOCATION_KEYS = ("checkpoint.", "tracking.", "data.cache_dir")
"""Config keys (prefixes) that say where a run stores things or how it is named, not what it trains."""

PARAM_CHARS = 6000
"""MLflow keeps at most this many characters of a param value (``pretrain.train.tracking`` logs them cut there)."""


def stores(paths: list[Path]) -> list[Path]:
    """The MLflow stores (``mlflow.db``) each of ``paths`` names: the file itself, or every one below a directory;
    a path with none is refused in one line (``ConfigError``)."""
    from pretrain.config import ConfigError

    found: list[Path] = []
    for p in map(Path, paths):
        dbs = [p] if p.is_file() else sorted(p.glob("**/mlflow.db"))
        if not dbs:
            raise ConfigError(f"--reuse {p}: no MLflow store (mlflow.db) there")
        found += [d.resolve() for d in dbs if d.resolve() not in found]
    return found


def _tokenizer_digest(path: str) -> str | None:
    """sha256 of the ``tokenizer.json`` that ``path`` (``data.tokenizer``: a directory or the file) names; None
    when there is none."""
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


def same_config(want: dict[str, Any], params: dict[str, str], defaults: dict[str, Any] | None = None) -> bool:
    """Whether a run logged with ``params`` trained what the flat config ``want`` asks for (its location keys
    aside; ``data.tokenizer`` equal as text or by the content of the tokenizer it names). A key the run did not log
    at all (a config field added since it ran) matches when ``want`` leaves it at its value in ``defaults`` (the
    flat default config): a new field's default keeps what the code did before it. (A field renamed since, whose old
    name the run logged with another value, would match at its new name's default: the code is the user's to keep
    equal, as the module says.)"""
    for key, value in want.items():
        if key.startswith(LOCATION_KEYS):
            continue
        text, have = str(value)[:PARAM_CHARS], params.get(key)
        if have == text:
            continue
        if have is None and defaults is not None and key in defaults and str(defaults[key]) == str(value):
            continue
        if key == "data.tokenizer" and have and text:
            digest = _tokenizer_digest(text)
            if digest is not None and digest == _tokenizer_digest(have):
                continue
        return False
    return True


def find(uris: list[str], want: dict[str, Any], steps: int) -> tuple[str, Any] | None:
    """(store URI, MLflow run) of a finished run in one of the stores ``uris`` that trained ``want``
    (:func:`same_config`, against the default config; whatever its name) to its last step ``steps``, the earliest
    of the first store that has one; None when there is none."""
    from mlflow import MlflowClient

    from pretrain.config import flatten, from_dict, to_dict

    defaults = flatten(to_dict(from_dict({})))
    for uri in uris:
        client = MlflowClient(tracking_uri=uri)
        ids = [e.experiment_id for e in client.search_experiments()]
        found = client.search_runs(
            ids, "attributes.status = 'FINISHED'", max_results=50_000, order_by=["start_time ASC"]
        )
        for run in found:
            if not same_config(want, run.data.params, defaults):
                continue
            losses = client.get_metric_history(run.info.run_id, "train/loss")
            if losses and max(m.step for m in losses) >= steps:
                return uri, run
    return None
