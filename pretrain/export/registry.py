"""MLflow records of an export: the logged model of its run and ``--register NAME``'s Model Registry version.

Both record the export directory by path (no weights go through MLflow). The directory's manifest
(:mod:`pretrain.export.output`) lists them: before the files are moved in (what will name the directory), then with
the ids MLflow gave them, so that a later export never puts other weights where they point.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pretrain.export.output import note_reference


def mlflow_references(run_id: str | None, register: str | None) -> list[dict[str, Any]]:
    """The records :func:`record_export` will make (for the manifest, before they exist)."""
    return ([{"mlflow_run": run_id}] if run_id else []) + ([{"registered_model": register}] if register else [])


def register_model(
    name: str, out: Path, *, run_id: str | None, step: int, checkpoint: Path, hf_class: str, uri: str | None = None
) -> int:
    """A new version of registered model ``name`` whose source is the exported directory (a file URI).

    Nothing is uploaded: the registry records where the export lives, the run it came from, the step.
    """
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pretrain.train.tracking import tracking_uri

    client = MlflowClient(tracking_uri=uri or tracking_uri(), registry_uri=uri or tracking_uri())
    try:
        client.create_registered_model(name, description="Hugging Face exports of pretrain checkpoints")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = {
        "pretrain.step": str(step),
        "pretrain.checkpoint": str(checkpoint),
        "pretrain.hf_class": hf_class,
        "pretrain.export_dir": str(out),
    }
    mv = client.create_model_version(
        name,
        source=Path(out).resolve().as_uri(),
        run_id=run_id,
        tags=tags,
        description=f"{hf_class} export of step {step} ({checkpoint})",
    )
    return int(mv.version)


def record_export(
    out: Path, *, run_id: str | None, register: str | None, step: int, checkpoint: Path, hf_class: str, log=print
) -> int | None:
    """Log ``out`` as a logged model of ``run_id`` (a run of the tracking store) and register it as ``register``;
    note both in its manifest; returns the registered version."""
    run_ref, reg_ref = mlflow_references(run_id, None), mlflow_references(None, register)
    if run_id:  # the run's Logged models section
        from pretrain.train.mlflow_records import log_exported_model
        from pretrain.train.tracking import tracking_uri

        model_id = log_exported_model(tracking_uri(), run_id, out, step=step, checkpoint=checkpoint, hf_class=hf_class)
        note_reference(out, run_ref[0], {**run_ref[0], "logged_model": model_id})
        log(f"[export] logged model {model_id} of run {run_id}")
    if not register:
        return None
    version = register_model(register, out, run_id=run_id, step=step, checkpoint=checkpoint, hf_class=hf_class)
    note_reference(out, reg_ref[0], {**reg_ref[0], "version": version})
    link = f"run {run_id}" if run_id else "no tracked run"
    log(f"[export] registered {register} version {version} ({link}, step {step})")
    return version
