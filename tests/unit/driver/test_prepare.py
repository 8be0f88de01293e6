"""A run whose creation fails after its MLflow run exists (the tokenizer, the vocabulary check, an interrupt) ends
FAILED or KILLED in MLflow, never left RUNNING (a real sqlite store)."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from pretrain.config import ConfigError, load_config
from pretrain.driver.prepare import create_run
from pretrain.train import tracking


@pytest.mark.parametrize(
    ("error", "status"), [(ConfigError("model.vocab_size: too small"), "FAILED"), (KeyboardInterrupt(), "KILLED")]
)
def test_a_failed_creation_ends_the_mlflow_run(tmp_path, monkeypatch, error, status):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'checkpoints'}"])

    def complete(run_dir):
        raise error

    with pytest.raises(type(error)):
        create_run(cfg, complete=complete)
    (run,) = tracking.list_runs(uri)
    assert MlflowClient(uri).get_run(run.info.run_id).info.status == status
