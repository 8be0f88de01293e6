"""What a run shows in MLflow's Datasets and Logged models sections (nothing large goes through the server).

* :func:`log_datasets`: each data source as an MLflow dataset input of the run — a ``MetaDataset`` (metadata
  only: no rows are read or uploaded) named like its metrics (:func:`pretrain.config.source_name`), whose source
  is the files' location (a hub dataset: its URL) and whose digest fingerprints the resolved files (paths, sizes,
  modification times; a hub dataset: name and split). Context ``training`` for ``data.sources`` (with the split
  tag ``train``, and ``val_holdout`` as a tag), ``validation`` for ``data.val_sources``.
* :func:`log_exported_model`: a Hugging Face export as a logged model of its run, external (MLflow records the
  export directory; the weights stay there), with step, checkpoint and class as params and tags.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from pretrain.config import RunConfig, SourceConfig, source_name
from pretrain.config.errors import without_passwords

CONTEXT_TAG = "mlflow.data.context"
EXPORT_DIR_TAG = "pretrain.export_dir"


STORE_TIMEOUT_S = 10.0
"""How long a tracking server may take to accept a connection before a command gives up on it (MLflow itself retries
a request for minutes)."""


def check_store(uri: str, probe: bool = True) -> None:
    """Refuse in one line (a :class:`ConfigError` naming ``MLFLOW_TRACKING_URI``) a store no command can use: a
    file store, which MLflow 3 refuses (unless ``MLFLOW_ALLOW_FILE_STORE=true``), or (``probe``) a tracking server
    that does not accept a connection within :data:`STORE_TIMEOUT_S`; one reached through a proxy
    (``HTTPS_PROXY``...) is left to MLflow, whose requests take the proxy."""
    import socket
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    from pretrain.config import ConfigError
    from pretrain.train.mlflow_store import shown_uri

    parts = urlsplit(uri)
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")
    if parts.scheme in ("", "file") and not allowed:
        raise ConfigError(
            f"MLFLOW_TRACKING_URI: {shown_uri(uri)} is a file store, which MLflow 3 refuses: use a database store "
            "(sqlite:///mlflow.db, the default), or set MLFLOW_ALLOW_FILE_STORE=true"
        )
    proxies = getproxies()  # (ALL_PROXY too, which requests takes for any scheme)
    proxied = bool({parts.scheme, "all"} & set(proxies)) and not proxy_bypass(parts.hostname or "")
    if probe and parts.scheme in ("http", "https") and not proxied:
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            socket.create_connection((parts.hostname or "", port), timeout=STORE_TIMEOUT_S).close()
        except (OSError, ValueError) as e:  # refused, unknown host, timed out; a port out of range
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            raise ConfigError(
                f"MLFLOW_TRACKING_URI: the tracking server {shown_uri(uri)} does not answer ({why}): start it, or "
                "point MLFLOW_TRACKING_URI at a store that does"
            ) from None


def mlflow_client(uri: str, probe: bool = True):
    """An MLflow client of ``uri`` (telemetry off unless the user turned it on), once :func:`check_store` passes
    (``probe``: with its connection to a tracking server); a new local store starts from MLflow's empty one
    (:mod:`pretrain.train.mlflow_store`)."""
    check_store(uri, probe)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient

    from pretrain.train.mlflow_store import seed_store

    seed_store(uri)

    return MlflowClient(tracking_uri=uri)


def _dataset(src: SourceConfig, cfg: RunConfig):
    """The MLflow dataset of one source (resolved as training resolves it)."""
    from mlflow.data.dataset_source_registry import get_registered_sources
    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    from pretrain.data.sources import resolve_source

    resolved = resolve_source(src, cfg.data.cache_dir)
    h = hashlib.sha256()
    if resolved.format == "hub":
        pin = f"\0{resolved.revision}" if resolved.revision else ""
        h.update(f"{resolved.hub_path}\0{resolved.split}{pin}".encode())
        url = (
            resolved.hub_path if "://" in resolved.hub_path else f"https://huggingface.co/datasets/{resolved.hub_path}"
        ) + (f"/tree/{resolved.revision}" if resolved.revision else "")
        source = HTTPDatasetSource(without_passwords(url))  # credentials in a URL stay out of the store
    else:
        for f in resolved.files:
            st = Path(f).stat()
            h.update(f"{Path(f).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        root = resolved.files[0] if len(resolved.files) == 1 else os.path.commonpath(resolved.files)
        # MLflow registers its local-file source twice (schemes '' and 'file'): resolving a path warns that it
        # "can be interpreted in multiple ways" on stderr. Both are the same class of source; take the first.
        local: Any = next(s for s in get_registered_sources() if s._get_source_type() == "local")  # a class
        source = local(str(Path(root).resolve()))
    # MetaDataset is concrete at runtime (not an ABC); its stubs inherit Dataset's abstract ``profile``
    return MetaDataset(source, name=source_name(src.path, src.name), digest=h.hexdigest()[:12])  # type: ignore[abstract]


def log_datasets(uri: str, run_id: str, cfg: RunConfig) -> int:
    """Log every source of ``cfg.data`` as a dataset input of ``run_id``; returns how many."""
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for context, group in (("training", cfg.data.sources), ("validation", cfg.data.val_sources)):
        for src in group:
            tags = [InputTag(CONTEXT_TAG, context), InputTag("split", src.split if context == "training" else "val")]
            if context == "training" and not cfg.data.val_sources and cfg.data.val_holdout > 0:
                tags.append(InputTag("val_holdout", f"{cfg.data.val_holdout:g}"))
            inputs.append(DatasetInput(_dataset(src, cfg)._to_mlflow_entity(), tags))
    if inputs:
        mlflow_client(uri).log_inputs(run_id, datasets=inputs)
    return len(inputs)


def log_exported_model(uri: str, run_id: str, out: Path, *, step: int, checkpoint: Path, hf_class: str) -> str:
    """Record the export directory ``out`` as an external logged model of ``run_id`` (READY); returns its id."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models.utils import get_external_mlflow_model_spec
    from mlflow.utils.file_utils import TempDir

    client = mlflow_client(uri)
    run = client.get_run(run_id)
    out = Path(out).resolve()
    model = client.create_logged_model(
        run.info.experiment_id,
        name=f"{out.name}-step{step}",
        source_run_id=run_id,
        model_type="huggingface",
        tags={EXPORT_DIR_TAG: str(out), "pretrain.checkpoint": str(checkpoint), "pretrain.hf_class": hf_class},
        params={"step": str(step), "hf_class": hf_class, "export_dir": str(out)},
    )
    with TempDir() as tmp:  # the MLmodel stub of an external model (a few hundred bytes), as MLflow's own does
        get_external_mlflow_model_spec(model).save(tmp.path("MLmodel"))
        client.log_model_artifacts(model.model_id, tmp.path())
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step)])
    return model.model_id
