"""``eval`` through the CLI: one JSON object on stdout, the metrics logged to the checkpoint's MLflow run, the
optional harness line; the table in-process."""

from __future__ import annotations

import json

import pytest

from tests.conftest import corpus_lines
from tests.integration.checkpoint.test_export import run_cli
from tests.unit.export.test_hf import (  # noqa: F401 - the autouse fixture is used by name
    one_thread,
    perturbed_state,
    small_run_config,
    write_checkpoint,
)


def test_cli_eval_json_mlflow_and_harness(tokenizer_dir, workdir, capsys):
    from mlflow import MlflowClient

    from pretrain.train import tracking

    uri = tracking.tracking_uri()
    cfg = small_run_config(workdir, tokenizer_dir, ["model.norm=rmsnorm", "model.activation=swiglu"])
    run_id = tracking.start_run(uri, cfg)
    run_dir = workdir / "checkpoints" / run_id
    write_checkpoint(run_dir, cfg, perturbed_state(cfg.model), tokenizer_dir, 7, run_id=run_id)
    tracking.Tracker(uri, run_id).set_tags({tracking.TAG_CKPT_ROOT: str(run_dir)})

    proc = run_cli(workdir, "eval", run_id, "--json", "--harness", "hellaswag,arc_easy")
    result = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert {"loss", "ppl", "bits_per_byte"} <= set(result) and "mlm_acc" not in result
    assert result["step"] == 7 and result["mlflow_run_id"] == run_id
    harness = [line for line in proc.stderr.splitlines() if line.startswith("harness:")]
    assert len(harness) == 1 and "hellaswag" in harness[0]
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(run_id, "eval/bits_per_byte")
    assert [(m.step, m.value) for m in history] == [(7, pytest.approx(result["bits_per_byte"]))]
    assert any(f.path == "eval" for f in client.list_artifacts(run_id))

    from pretrain.cli import main  # the table, in-process (same entry point as the launcher)

    assert main(["eval", str(run_dir), "--no-sample"]) == 0
    table = capsys.readouterr().out
    assert "bits per byte" in table and "perplexity" in table and f"MLflow run {run_id}" in table

    other = workdir / "other-text.txt"  # other data is logged under its own name, never over the run's own
    other.write_text("\n".join(corpus_lines(300)) + "\n", encoding="utf-8")
    assert main(["eval", run_id, "--no-sample", "--json", "--data", str(other)]) == 0
    on_other = json.loads(capsys.readouterr().out)
    own = client.get_metric_history(run_id, "eval/bits_per_byte")  # the JSON's and the table's evals
    assert len(own) == 2 and {m.step for m in own} == {7}
    assert all(m.value == pytest.approx(result["bits_per_byte"]) for m in own)
    assert on_other["bits_per_byte"] != pytest.approx(result["bits_per_byte"])
    logged = client.get_metric_history(run_id, "eval/other-text/bits_per_byte")
    assert [(m.step, m.value) for m in logged] == [(7, pytest.approx(on_other["bits_per_byte"]))]
