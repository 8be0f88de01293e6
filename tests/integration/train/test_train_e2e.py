"""End to end through the real CLI, real Ray Train (2 workers, gloo), real MLflow (sqlite): training, exact resume
from a checkpoint directory and of a killed job by run id, a worker's restart, an elastic resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.harness import CONFIG, E2E, cli, metric_history, run_id_of, start_cli


def _losses(tmp_path: Path, run_id: str) -> dict[int, float]:
    return metric_history(run_id, uri=f"sqlite:///{tmp_path / 'mlflow.db'}")


def _final_weights(run_dir: Path) -> dict:
    from pretrain.export.checkpoints import consolidated_state_dict

    return consolidated_state_dict(run_dir / "step_00000008", zero_stage=1)


def test_resume_from_checkpoint_dir_is_bitwise(reference):
    """A new run forked from the reference run's step-4 checkpoint directory continues it bitwise: the later steps'
    losses and the final weights."""
    work, ref = reference["work"], reference["losses"]
    forked = cli(work, "resume", str(reference["run_dir"] / "step_00000004"))
    fork_id = run_id_of(forked.stdout)
    fork = _losses(work, fork_id)
    print("\nreference:", ref, "\nresumed:  ", fork)
    assert sorted(fork) == [5, 6, 7, 8]
    assert all(fork[s] == ref[s] for s in fork)
    a, b = _final_weights(reference["run_dir"]), _final_weights(work / "checkpoints" / fork_id)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def killed_job(reference):
    """One job SIGKILLed as a whole (driver and its embedded Ray) after a commit, then resumed by run id:
    ``checkpoint.async`` (the default) writes step 6's checkpoint in the background (slowed to 600 s by the fault
    hook) while training goes on to step 8, whose save waits for it; the job is killed there."""
    work = reference["work"]
    proc = start_cli(
        work,
        "train",
        CONFIG,
        *E2E,
        "faults.slow_checkpoint_at_step=6",
        "faults.slow_checkpoint_s=600",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    run_id, seen = None, []
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        seen.append(line)
        if line.startswith("[pretrain] run "):
            run_id = line.split()[2].rstrip(":")
        if "step 8/8" in line:  # trained past step 6 while its checkpoint was being written
            break
    assert run_id and proc.poll() is None, "job ended before it could be killed:\n" + "".join(seen[-40:])
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    killed_at_ms = int(time.time() * 1000)
    run_dir = work / "checkpoints" / run_id
    at_kill = {
        "steps": [p.name for p in sorted(run_dir.glob("step_*"))],
        "in_flight": list(run_dir.glob(".tmp-step_00000006-*")),
    }
    resumed = cli(work, "resume", run_id)
    return {
        "run_id": run_id,
        "run_dir": run_dir,
        "seen": seen,
        "at_kill": at_kill,
        "resumed": resumed,
        "killed_at_ms": killed_at_ms,
    }


def test_killed_job_resumes_by_run_id(reference, killed_job):
    """SIGKILL the whole job (driver and its embedded Ray) after a commit; `resume RUN_ID` finishes it."""
    work, run_id, resumed = reference["work"], killed_job["run_id"], killed_job["resumed"]
    assert killed_job["at_kill"]["steps"], "killed after a commit"
    assert "resumed from" in resumed.stdout and run_id in resumed.stdout
    losses = _losses(work, run_id)
    assert all(losses[s] == reference["losses"][s] for s in range(1, 9)), (losses, reference["losses"])
    from mlflow import MlflowClient  # the resume's own losses: steps 5-8 logged again, after the kill

    history = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_metric_history(run_id, "train/loss")
    again = {m.step: m.value for m in history if m.timestamp > killed_job["killed_at_ms"]}
    assert again == {s: reference["losses"][s] for s in range(5, 9)}, (again, reference["losses"])

    listing = cli(work, "runs").stdout
    assert reference["run_id"] in listing and run_id in listing
    detail = cli(work, "runs", run_id).stdout
    assert "step_00000008" in detail and "step_00000004" in detail
    # the resume's config, named by the step it resumed from (one per resume)
    config = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").list_artifacts(run_id, "config")
    assert [a.path for a in config if a.path.startswith("config/resumed")] == ["config/resumed_step_00000004.yaml"]


def test_sigkill_during_a_background_write_resumes_from_the_last_commit_bitwise(reference, killed_job):
    """``checkpoint.async`` (the default): step 6's checkpoint is written in the background (slowed to 600 s by the
    fault hook) while training goes on to step 8, whose save waits for it; the whole job SIGKILLed there resumes
    from step 4, the last committed checkpoint, and reproduces the uninterrupted run's losses bitwise. The
    reference run itself saved asynchronously: its summary reports each save's stall and host snapshot."""
    work, ref = reference["work"], reference["losses"]
    summary = json.loads((reference["run_dir"] / "summary.json").read_text())
    saves = summary["checkpoint_saves"]
    assert summary["checkpoint_async"] and [s["step"] for s in saves] == [2, 4, 6, 8]
    assert all(s["snapshot_gb"] > 0 and s["write_s"] > 0 and s["stall_s"] >= s["snapshot_s"] for s in saves)
    run_id, run_dir, seen = killed_job["run_id"], killed_job["run_dir"], killed_job["seen"]
    assert killed_job["at_kill"]["steps"] == ["step_00000002", "step_00000004"]
    assert killed_job["at_kill"]["in_flight"], "".join(seen[-40:])  # the write in flight, uncommitted
    out = "".join(seen)
    assert "background write of step 6's checkpoint sleeps 600 s" in out
    assert "checkpoint committed: step 4" in out and "checkpoint committed: step 6" not in out
    resumed = killed_job["resumed"]
    assert f"resumed from {run_dir / 'step_00000004'}" in resumed.stdout, resumed.stdout[-2000:]
    assert "checkpoint committed: step 6" in resumed.stdout and "sleeps" not in resumed.stdout  # fired once
    losses = _losses(work, run_id)
    assert all(losses[s] == ref[s] for s in range(1, 9)), (losses, ref)
    a, b = _final_weights(reference["run_dir"]), _final_weights(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_worker_sigkill_restarts_from_last_commit_bitwise(reference):
    work = reference["work"]
    proc = cli(work, "train", CONFIG, *E2E, "faults.kill_worker_at_step=5", "cluster.max_failures=1")
    assert "kills itself with SIGKILL at step 5" in proc.stdout + proc.stderr
    run_id = run_id_of(proc.stdout)
    assert "resumed from" in proc.stdout + proc.stderr
    losses = _losses(work, run_id)
    assert all(losses[s] == reference["losses"][s] for s in range(1, 9)), (losses, reference["losses"])
    a, b = _final_weights(reference["run_dir"]), _final_weights(work / "checkpoints" / run_id)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_elastic_resume_two_one_two_workers(reference):
    """2 workers -> 1 -> 2: ZeRO state re-sharded through a DeepSpeed universal checkpoint; the data
    position is the union of all workers' stream states, so the global batches stay the same."""
    work, ref = reference["work"], reference["losses"]
    one = cli(
        work, "resume", str(reference["run_dir"] / "step_00000004"), "cluster.num_workers=1", "faults.stop_after_step=6"
    )
    run_id = run_id_of(one.stdout)
    assert "elastic resume: 2 -> 1 workers" in one.stdout + one.stderr
    two = cli(work, "resume", run_id, "cluster.num_workers=2")
    assert "elastic resume: 1 -> 2 workers" in two.stdout + two.stderr
    losses = _losses(work, run_id)
    print("\nreference:", ref, "\nelastic:  ", losses)
    assert sorted(losses) == [5, 6, 7, 8]
    for s in losses:  # 1 worker accumulates 2 micro-batches where 2 workers all-reduce: same math, other order
        assert abs(losses[s] - ref[s]) < 1e-5, (s, losses[s], ref[s])


def test_a_zero0_run_resumes_on_another_worker_count(tmp_path):
    """ZeRO-0 keeps its model and optimizer state whole (no partitioned optimizer files, so no universal form to
    convert to): a 2-worker run (torchrun) resumes from its step-4 checkpoint on 1 worker as it is, and the next
    steps' losses are the uninterrupted run's."""
    run = ["train", CONFIG, *E2E, "zero.stage=0", "cluster.use_ray=false", "train.max_steps=6"]
    whole = run_id_of(cli(tmp_path, *run, ranks=2).stdout)
    step4 = tmp_path / "checkpoints" / whole / "step_00000004"
    one = cli(tmp_path, "resume", str(step4), "cluster.num_workers=1", "cluster.use_ray=false")
    assert "universal" not in one.stdout + one.stderr
    ref, losses = _losses(tmp_path, whole), _losses(tmp_path, run_id_of(one.stdout))
    assert sorted(losses) == [5, 6]
    for s in losses:  # 1 worker accumulates 2 micro-batches where 2 workers all-reduce: same math, other order
        assert abs(losses[s] - ref[s]) < 1e-5, (s, losses[s], ref[s])


def test_tasks_on_two_workers_match_offline_eval(reference):
    """``eval.tasks`` in the 2-worker run (each rank scores its share of the examples, the counts are all-reduced)
    gives what ``eval --tasks`` gives in one process on the same checkpoint."""
    import json

    from mlflow import MlflowClient

    work, run_id = reference["work"], reference["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    in_loop = {m.step: m.value for m in client.get_metric_history(run_id, "eval/heldout_lastword/acc")}
    assert sorted(in_loop) == [4, 8], in_loop
    out = cli(
        work,
        "eval",
        str(reference["run_dir"] / "step_00000008"),
        "--tasks",
        "heldout_lastword",
        "--max-examples",
        "16",
        "--no-sample",
        "--json",
    )
    offline = json.loads(out.stdout)["tasks"]
    assert offline == {"eval/heldout_lastword/acc": in_loop[8]}, (offline, in_loop)


def test_bad_records_fail_policy_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = '{"text": "A perfectly fine sentence about the weather and the sea."}\n'
    bad.write_text(good * 50 + '{"text": "unterminated\n' + good * 5)
    proc = cli(
        tmp_path,
        "train",
        *E2E,
        f"data.sources=[{{path: {bad}}}]",
        "data.bad_records=fail",
        "cluster.use_ray=false",
        expect=2,
    )
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert err and f"{bad}:51" in err[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_bad_records_are_reported_whole_on_any_worker_count(tmp_path):
    """Skipped bad records are counted once each and reported whole (count, reasons, first lines) whichever worker
    read them: the same run on 1 worker and on 2 (torchrun) reports the same ``data/bad_records.json``."""
    from mlflow import MlflowClient

    data = tmp_path / "bad.jsonl"
    lines = [f'{{"text": "Sentence {i} about the weather, the sea and the harbour."}}\n' for i in range(400)]
    for i in (20, 149, 260, 389):  # 1-based lines 21, 150, 261 and 390, spread over the file
        lines[i] = '{"text": "unterminated\n' if i % 2 else '{"txt": "wrong field"}\n'
    data.write_text("".join(lines))
    reports = []
    for workers in (1, 2):
        work = tmp_path / f"w{workers}"
        work.mkdir()
        args = ["train", *E2E, f"data.sources=[{{path: {data}}}]", "cluster.use_ray=false"]
        proc = cli(work, *args, f"cluster.num_workers={workers}", ranks=workers)
        run_id = run_id_of(proc.stdout)
        client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
        reports.append(
            json.loads(Path(client.download_artifacts(run_id, "data/bad_records.json", str(work))).read_text())
        )
        assert f"bad records skipped: {reports[-1]['total']} " in proc.stdout + proc.stderr
    one, two = reports
    assert one == two and one["total"] >= 2 and sum(one["by_reason"].values()) == one["total"], (one, two)
    assert all(e.startswith(f"{data}:") for e in one["examples"]), one
