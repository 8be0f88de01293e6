"""Annealing a WSD run (``./launch.sh anneal``): the child's schedule, its argument checks, and (slow) the CLI:
a stable run, a child annealed from one of its checkpoints, lineage, the LR curve, training and export."""

from __future__ import annotations

import subprocess

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.driver.anneal import anneal, annealed_config
from pretrain.train.schedule import lr_at
from tests.conftest import PYTHON, ROOT, cli_env

TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.max_seq_len=32",
        "data.tokenizer_vocab_size=512", "data.tokenizer_train_docs=500", "data.num_streams=2",
        "train.global_batch_size=8", "train.micro_batch_size=8", "train.lr=1e-2", "train.min_lr_ratio=0.1",
        "train.warmup_steps=2", "train.log_every=1", "train.val_every=0", "train.val_sequences=8",
        "checkpoint.every_steps=2", "cluster.num_workers=1", "cluster.use_ray=false", "stability.plot_at_end=false"]


def test_annealed_schedule_decays_from_the_checkpoint_lr_to_the_floor():
    parent = load_config(None, TINY + ["train.decay=wsd", "train.max_steps=1000", "train.decay_steps=200"])
    child = annealed_config(parent, 400, 50, ["train.decay_shape=linear"])
    t = child.train
    assert (t.decay, t.max_steps, t.decay_steps, t.warmup_steps) == ("wsd", 450, 50, 0)
    lrs = [lr_at(s, t) for s in range(400, 450)]
    assert lrs[0] == pytest.approx(1e-2 - 0.9e-2 / 50) and lrs[-1] == pytest.approx(1e-3)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    # from a point of a cosine run: from the LR of the checkpoint's last step (49), to the same absolute floor
    cos = load_config(None, TINY + ["train.max_steps=100"])
    t = annealed_config(cos, 50, 10).train
    assert t.lr == pytest.approx(lr_at(49, cos.train)) and lr_at(59, t) == pytest.approx(1e-3)


@pytest.mark.parametrize("args, message", [
    (["steps=5"], "give a run id or a checkpoint directory first"),
    (["RUN"], "steps=N (the length of the decay, > 0) is required"),
    (["RUN", "steps=0"], "steps=N (the length of the decay, > 0) is required"),
    (["RUN", "steps=5", "depth=2x"], "anneal: unknown option(s) ['depth']"),
    (["RUN", "steps=5", "step=x"], "step=S must be a checkpoint step"),
])
def test_bad_anneal_arguments_are_one_line(args, message):
    with pytest.raises(ConfigError) as e:
        anneal(args)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_anneal_child_run_decays_to_the_floor_trains_and_exports(tmp_path):
    """A WSD run (stable after a 2-step warm-up), annealed from its step-4 checkpoint over 3 steps with a config
    override: a child MLflow run with lineage tags whose LR falls from the peak to the floor, carrying the
    parent's data position; it trains (resume) and exports. A second child, annealed where the parent's own decay
    starts, retraces the parent's losses: the optimizer state is carried, not restarted."""
    from mlflow import MlflowClient

    def cli(*args, code=0):
        proc = subprocess.run([PYTHON, "-m", "pretrain", *args], cwd=tmp_path, env=cli_env(tmp_path),
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == code, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc.stdout + proc.stderr

    out = cli("train", str(ROOT / "configs" / "demo-decoder.yaml"), *TINY, "train.max_steps=10",
              "train.decay=wsd", "train.decay_steps=4")
    parent = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("MLflow run id"))
    err = cli("anneal", parent, "steps=3", "step=4", "train.decay_shape=sqrt", code=2)
    assert "train.decay_shape: expected one of linear, cosine, 1-sqrt" in err and "Traceback" not in err
    out = cli("anneal", parent, "steps=3", "step=4", "train.decay_shape=linear")
    child = next(line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith("[anneal] new run"))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    tags = client.get_run(child).data.tags
    assert tags["pretrain.derived"] == "anneal" and tags["mlflow.parentRunId"] == parent
    assert (tags["anneal.parent_run_id"], tags["anneal.parent_step"], tags["anneal.steps"]) == (parent, "4", "3")
    assert f"anneal of run {parent} at step 4: LR decay to the floor over 3 steps (linear)" in cli("runs", child)
    cli("resume", child)
    lr = {x.step: x.value for x in client.get_metric_history(child, "train/lr")}
    assert sorted(lr) == [5, 6, 7], "the child continues the parent's step count"
    assert lr[5] == pytest.approx(1e-2 - 0.9e-2 / 3) and lr[6] == pytest.approx(1e-2 - 0.9e-2 * 2 / 3)
    assert lr[7] == pytest.approx(1e-3), "the last step is at the floor"
    parent_lr = {x.step: x.value for x in client.get_metric_history(parent, "train/lr")}
    assert parent_lr[5] == parent_lr[6] == pytest.approx(1e-2), "the parent's stable phase"
    report = cli("export", child, "--out", str(tmp_path / "hf"))
    assert "parity" in report

    # the child continues the parent's optimization (weights, AdamW moments and step, data position): annealed at
    # the start of the parent's own decay over its length, it retraces the parent (the floor LR is recomputed from
    # the checkpoint's LR: an ulp apart at most)
    err = cli("anneal", parent, "steps=4", "step=6", "model.hidden_size=64", code=2)
    assert "anneal: model cannot change" in err and "Traceback" not in err
    out = cli("anneal", parent, "steps=4", "step=6")
    twin = next(line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith("[anneal] new run"))
    cli("resume", twin)
    ref = {x.step: x.value for x in client.get_metric_history(parent, "train/loss")}
    got = {x.step: x.value for x in client.get_metric_history(twin, "train/loss")}
    assert sorted(got) == [7, 8, 9, 10]
    assert all(abs(got[s] - ref[s]) <= 1e-6 * ref[s] for s in got), ({s: ref[s] for s in got}, got)
