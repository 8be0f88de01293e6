"""Fault injection in real 2-worker training (the real train loop on real gloo ranks): a NaN gradient on one rank
skipped on all, a loss spike rolled back with its data window skipped, bitwise resume through a rollback (also from
a stop's checkpoint), and NaN weights at a stop rolled back and saved. The skip as an exact no-op, halt and DeepNorm:
``test_stability.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pretrain.config import load_config
from tests.conftest import ROOT, in_workdir
from tests.harness import CONFIG, metric_history, run_jobs, tiny_model

# ----------------------------------------------------------------------------------------------
# Fault injection in real 2-worker training (the real train_loop on real gloo ranks)
# ----------------------------------------------------------------------------------------------

TINY = [
    *tiny_model(hidden_size=64, num_kv_heads=2, max_seq_len=32, vocab_size=None),
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=3000",
    "data.num_streams=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=24",
    "train.warmup_steps=2",
    "train.decay=constant",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_sequences=8",
    "checkpoint.every_steps=4",
    "cluster.num_workers=2",
    "cluster.use_ray=false",
    "stability.window=16",
    "stability.warmup_steps=6",
    "stability.good_after_steps=2",
    "stability.health_every=4",
    "stability.lr_cooldown_steps=4",
    "stability.max_consecutive_skips=3",
    "stability.plot_at_end=false",
]


def _all_finite(root: Path) -> tuple[int, list[str]]:
    """(tensors checked, files holding NaN/Inf) over every checkpoint file under ``root``."""
    checked, bad = 0, []

    def walk(x, f):
        nonlocal checked
        if torch.is_tensor(x):
            checked += 1
            if x.is_floating_point() and not torch.isfinite(x).all():
                bad.append(f)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v, f)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, f)

    for f in sorted(root.rglob("*.pt")):
        walk(torch.load(f, map_location="cpu", weights_only=False), str(f))
    return checked, bad


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    """Real 2-worker runs of 24 steps in one pair of processes: clean, NaN gradient on rank 1 at step 5 (policy
    skip), LR x1000 at step 13 (policy rollback), the rollback run stopped at step 11; then, in a fresh pair, the
    rollback run resumed from its step-8 checkpoint (before the fault) and from the checkpoint of that stop."""
    from pretrain.driver.prepare import prepare_new

    with in_workdir(tmp_path_factory.mktemp("stability")) as work:
        clean = prepare_new(load_config(ROOT / "configs" / "demo-decoder.yaml", TINY))
        tok = [f"data.tokenizer={Path(clean.run_dir) / 'tokenizer'}"]
        nan = prepare_new(
            load_config(
                ROOT / "configs" / "demo-decoder.yaml",
                TINY + tok + ["stability.policy=skip", "faults.nan_grad_at_step=5"],
            )
        )
        # validation at step 12, which the rollback (to step 8) makes the run go through twice
        spike_over = TINY + tok + ["stability.policy=rollback", "faults.loss_spike_at_step=13", "train.val_every=12"]
        spike = prepare_new(
            load_config(ROOT / "configs" / "demo-decoder.yaml", spike_over + ["stability.plot_at_end=true"])
        )
        resumed = prepare_new(load_config(ROOT / "configs" / "demo-decoder.yaml", spike_over))
        # resumes from a checkpoint the spike run writes first in the same processes (the driver's preflight
        # would refuse a checkpoint.resume_from that does not exist yet, so it is set on the prepared job)
        resumed.config["checkpoint"] = {
            **resumed.config["checkpoint"],
            "resume_from": str(Path(spike.run_dir) / "step_00000008"),
        }
        # stopped at step 11 (a checkpoint the uninterrupted run does not have) and resumed from that checkpoint
        stopped = prepare_new(
            load_config(ROOT / "configs" / "demo-decoder.yaml", spike_over + ["faults.stop_after_step=11"])
        )
        after_stop = prepare_new(load_config(ROOT / "configs" / "demo-decoder.yaml", spike_over))
        after_stop.config["checkpoint"] = {
            **after_stop.config["checkpoint"],
            "resume_from": str(Path(stopped.run_dir) / "step_00000011"),
        }

        def nan_stop_at(step: int):
            faults = [f"faults.nan_weights_at_step={step}", f"faults.stop_after_step={step}"]
            return prepare_new(load_config(CONFIG, [*TINY, *tok, "stability.policy=rollback", *faults]))

        # stopped at step 11 with a NaN weight since that step: the stop's checkpoint is refused and rolls back; the
        # same at step 12, a step the run saves at: its own save finds the NaN and rolls back to step 8, and the stop
        # then saves the restored state at step 8 (not left as step 8's earlier checkpoint)
        nan_stop, nan_stop_12 = nan_stop_at(11), nan_stop_at(12)
        first = {"clean": clean, "nan": nan, "spike": spike, "stopped": stopped}
        first.update(nan_stop=nan_stop, nan_stop_12=nan_stop_12)
        # the resumes in fresh processes: the checkpoints, not what the writing processes kept in memory, carry them
        then = {"resumed": resumed, "after_stop": after_stop}
        ranks = [
            a + b for a, b in zip(run_jobs(2, list(first.values()), fresh=False), run_jobs(2, list(then.values())))
        ]
        jobs = {**first, **then}
        yield {"work": work, "jobs": jobs, "ranks": ranks, "final": dict(zip(jobs, ranks[0]))}


def test_nan_gradient_on_one_rank_is_skipped_on_all_ranks(fault_runs):
    clean, nan = fault_runs["final"]["clean"], fault_runs["final"]["nan"]
    timelines = [r[1]["stability"]["timeline"] for r in fault_runs["ranks"]]
    print("\nNaN run events (rank 0):", timelines[0])
    assert timelines[0] == timelines[1], "every rank must decide the same"
    assert [(e["step"], e["kind"], e["action"]) for e in timelines[0]] == [(5, "nonfinite", "skip")]
    assert nan["stability"]["skipped_steps"] == 1 and nan["step"] == 24
    rel = abs(nan["final_train_loss"] - clean["final_train_loss"]) / clean["final_train_loss"]
    rel_val = abs(nan["val_loss"] - clean["val_loss"]) / clean["val_loss"]
    print(
        f"final train loss: clean {clean['final_train_loss']:.4f}, NaN-skipped {nan['final_train_loss']:.4f} "
        f"({100 * rel:.2f}%); val loss {clean['val_loss']:.4f} vs {nan['val_loss']:.4f} ({100 * rel_val:.2f}%)"
    )
    assert rel < 0.05 and rel_val < 0.05
    with_health = metric_history(fault_runs["jobs"]["nan"].run_id, "health/grad_norm/block01")
    assert sorted(with_health) == [4, 8, 12, 16, 20, 24]
    from mlflow import MlflowClient

    for key in ("train/loss", "train/grad_norm"):  # the event's step (a logged step here) is logged once
        steps = [m.step for m in MlflowClient().get_metric_history(fault_runs["jobs"]["nan"].run_id, key)]
        assert sorted(steps) == list(range(1, 25)), (key, sorted(steps))


def test_loss_spike_rolls_back_skips_the_data_window_and_finishes_finite(fault_runs):
    spike = fault_runs["final"]["spike"]
    events = spike["stability"]["timeline"]
    assert events == fault_runs["ranks"][1][2]["stability"]["timeline"]
    print("\nspike run events:", [(e["step"], e["kind"], e["action"], e["detail"]) for e in events])
    kinds = [(e["step"], e["kind"], e["action"]) for e in events]
    assert kinds[0] == (14, "loss_spike", "rollback"), kinds
    rb = events[1]
    # Checkpoint 12 saw only one healthy step before the spike: the newest good one is step 8.
    assert (rb["kind"], rb["to_step"], rb["data_window"]) == ("rollback", 8, [8 * 8, 14 * 8])
    assert spike["stability"]["skipped_windows"] == [[64, 112]] and spike["stability"]["rollbacks"] == 1
    assert spike["step"] == 24 and math.isfinite(spike["final_train_loss"]) and math.isfinite(spike["val_loss"])
    run_dir = Path(fault_runs["jobs"]["spike"].run_dir)
    state = json.loads((run_dir / "step_00000024" / "trainer_state.json").read_text())
    assert state["sequences"] == (24 + 6) * 8 and state["callbacks"]["faults_fired"] == {"fired": ["loss_spike"]}
    # the step after the rollback saved: a resume from there (a worker lost before the next periodic save at 12)
    # continues past the skipped window with the rollback recorded, not from step 8's data position
    state = json.loads((run_dir / "step_00000009" / "trainer_state.json").read_text())
    assert state["sequences"] == (9 + 6) * 8 and state["callbacks"]["stability"]["rollbacks"] == 1
    assert [Path(p).parent.name for p in rb["abandoned"]] == ["abandoned"]  # the old step_12
    from mlflow import MlflowClient

    client, run_id = MlflowClient(), fault_runs["jobs"]["spike"].run_id
    run = client.get_run(run_id)
    assert run.data.metrics["stability/events"] == 2 and run.data.metrics["stability/rollbacks"] == 1
    assert run.data.tags["pretrain.stability.last_event"] == "step 14: rollback -> restored"
    timeline = json.loads(Path(client.download_artifacts(run_id, "stability/timeline.json")).read_text())
    assert timeline["timeline"] == events and timeline["skipped_windows"] == [[64, 112]]
    losses = metric_history(fault_runs["jobs"]["spike"].run_id)
    assert max(losses.values()) < 10 and sorted(losses) == list(range(1, 25))
    # step 12 validated on both trajectories (before the spike, and again after the rollback), then step 24
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [12, 12, 24]
    assert Path(spike["plot"]).is_file()
    for job in fault_runs["jobs"].values():  # every checkpoint ever written, abandoned ones included
        checked, bad = _all_finite(Path(job.run_dir))
        assert checked > 0 and not bad, bad


def test_resume_through_a_rollback_is_bitwise(fault_runs):
    """Resumed from step 8 (before the injected spike): the same spike, the same rollback, the same
    skipped window and the same losses and final weights, bit for bit; also resumed from a stop's checkpoint."""
    from pretrain.export.checkpoints import consolidated_state_dict

    spike, resumed = fault_runs["final"]["spike"], fault_runs["final"]["resumed"]

    def events(final: dict) -> list[dict]:  # without the paths, which name each run's own directory
        return [
            {k: v for k, v in e.items() if k not in ("checkpoint", "abandoned")} for e in final["stability"]["timeline"]
        ]

    assert events(spike) == events(resumed) and len(events(spike)) == 2
    a, b = metric_history(fault_runs["jobs"]["spike"].run_id), metric_history(fault_runs["jobs"]["resumed"].run_id)
    print(
        "\nrollback run:",
        {s: round(v, 5) for s, v in a.items() if s > 8},
        "\nresumed run: ",
        {s: round(v, 5) for s, v in b.items()},
    )
    assert sorted(b) == list(range(9, 25)) and all(a[s] == b[s] for s in b)
    wa = consolidated_state_dict(Path(fault_runs["jobs"]["spike"].run_dir) / "step_00000024", zero_stage=1)
    wb = consolidated_state_dict(Path(fault_runs["jobs"]["resumed"].run_dir) / "step_00000024", zero_stage=1)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # Resumed from the checkpoint a stop wrote at step 11: not a rollback target (the uninterrupted run has none
    # there, and rolls back to step 8), so the same rollback, window and losses.
    after_stop = fault_runs["final"]["after_stop"]
    assert fault_runs["final"]["stopped"]["step"] == 11 and events(after_stop) == events(spike)
    c = metric_history(fault_runs["jobs"]["after_stop"].run_id)
    assert sorted(c) == list(range(9, 25)) and all(a[s] == c[s] for s in c)  # (9-11 again after the rollback)


@pytest.mark.parametrize("name, at", [("nan_stop", 11), ("nan_stop_12", 12)])
def test_non_finite_weights_at_a_stop_roll_back_and_the_restored_state_is_saved(fault_runs, name, at):
    """The checkpoint a stop writes (step 11), or the step's own (step 12), finds a NaN weight: the run rolls back to
    its last good checkpoint (step 8) and saves the restored state there (the skipped data window and the
    rollback's record), which a resume continues."""
    final, job = fault_runs["final"][name], fault_runs["jobs"][name]
    assert final["step"] == 8 and final["stability"]["rollbacks"] == 1, final["stability"]
    assert final["final_train_loss"] == metric_history(job.run_id)[8], final  # the restored state's, not step 11's
    run_dir = Path(job.run_dir)
    assert not (run_dir / f"step_{at:08d}").exists() and Path(final["checkpoint"]).name == "step_00000008"
    state = json.loads((run_dir / "step_00000008" / "trainer_state.json").read_text())
    window = final["stability"]["skipped_windows"]
    assert len(window) == 1 and window[0][0] == 8 * 8 and state["sequences"] == window[0][1], (state, window)
    assert state["callbacks"]["stability"]["rollbacks"] == 1 and state["callbacks"]["checkpoint"] == {"at_stop": True}
    checked, bad = _all_finite(run_dir)
    assert checked > 0 and not bad, bad
