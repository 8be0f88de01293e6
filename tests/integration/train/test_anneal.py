"""Annealing a WSD run through the CLI: a stable run, a child annealed from one of its checkpoints, lineage, the LR
curve, training and export."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT
from tests.harness import cli
from tests.unit.driver.test_anneal import TINY


def test_anneal_child_run_decays_to_the_floor_trains_and_exports(tmp_path):
    """A WSD run on 2 workers (stable after a 2-step warm-up), annealed from its step-4 checkpoint over 3 steps with a
    config override (one process writes the child's first checkpoint for both workers): a child MLflow run with
    lineage tags whose LR falls from the peak to the floor, carrying the
    parent's data position; it trains (resume) and exports. A second child, annealed where the parent's own decay
    starts, retraces the parent's losses: the optimizer state is carried, not restarted."""
    from mlflow import MlflowClient

    def run(*args, code=0, ranks=1):
        proc = cli(tmp_path, *args, expect=code, timeout=900, ranks=ranks)
        return proc.stdout + proc.stderr

    out = run(
        "train",
        str(ROOT / "configs" / "demo-decoder.yaml"),
        *TINY,
        "train.max_steps=10",
        "train.decay=wsd",
        "train.decay_steps=4",
        "cluster.num_workers=2",
        "tracking.run_name=wsd-parent",
        ranks=2,
    )
    parent = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("MLflow run id"))
    err = run("anneal", parent, "steps=3", "step=4", "train.decay_shape=sqrt", code=2)
    assert "train.decay_shape: expected one of linear, cosine, 1-sqrt" in err and "Traceback" not in err
    out = run("anneal", parent, "steps=3", "step=4", "train.decay_shape=linear")
    child = next(line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith("[anneal] new run"))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    tags = client.get_run(child).data.tags
    assert tags["pretrain.derived"] == "anneal" and tags["mlflow.parentRunId"] == parent
    assert client.get_run(child).info.run_name == "wsd-parent-anneal4", "a child's name differs from its parent's"
    assert (tags["anneal.parent_run_id"], tags["anneal.parent_step"], tags["anneal.steps"]) == (parent, "4", "3")
    assert f"anneal of run {parent} at step 4: LR decay to the floor over 3 steps (linear)" in run("runs", child)
    assert f"\n  child: {child} (wsd-parent-anneal4): anneal\n" in run("runs", parent)
    page = f"http://127.0.0.1:5000/#/experiments/{client.get_run(child).info.experiment_id}/runs/{child}"
    assert f"\n  MLflow:  {page}?workflowType=machine_learning\n" in out, out  # opens as model training
    assert f"\n  run in UI:   {page}?workflowType=machine_learning\n" in run("resume", child, ranks=2)
    lr = {x.step: x.value for x in client.get_metric_history(child, "train/lr")}
    assert sorted(lr) == [5, 6, 7], "the child continues the parent's step count"
    assert lr[5] == pytest.approx(1e-2 - 0.9e-2 / 3) and lr[6] == pytest.approx(1e-2 - 0.9e-2 * 2 / 3)
    assert lr[7] == pytest.approx(1e-3), "the last step is at the floor"
    parent_lr = {x.step: x.value for x in client.get_metric_history(parent, "train/lr")}
    assert parent_lr[5] == parent_lr[6] == pytest.approx(1e-2), "the parent's stable phase"
    report = run("export", child, "--out", str(tmp_path / "hf"))
    assert "parity" in report

    # the child continues the parent's optimization (weights, AdamW moments and step, data position): annealed at
    # the start of the parent's own decay over its length, it retraces the parent (the floor LR is recomputed from
    # the checkpoint's LR: an ulp apart at most)
    err = run("anneal", parent, "steps=4", "step=6", "model.hidden_size=64", code=2)
    assert "anneal: model cannot change" in err and "Traceback" not in err
    out = run("anneal", parent, "steps=4", "step=6")
    twin = next(line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith("[anneal] new run"))
    run("resume", twin, ranks=2)
    ref = {x.step: x.value for x in client.get_metric_history(parent, "train/loss")}
    got = {x.step: x.value for x in client.get_metric_history(twin, "train/loss")}
    assert sorted(got) == [7, 8, 9, 10]
    assert all(abs(got[s] - ref[s]) <= 1e-6 * ref[s] for s in got), ({s: ref[s] for s in got}, got)
