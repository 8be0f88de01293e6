"""A stop is a checkpoint, through the command line as users stop a run: SIGTERM (a scheduler's preemption) to a
run training in the command's process, Ctrl-C (SIGINT to the terminal's whole process group) to a run of two Ray
workers, a second signal. (``./launch.sh stop JOB`` on a submitted job:
``tests/integration/cluster/test_cluster.py``.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from mlflow import MlflowClient

from tests.harness import CONFIG, E2E, cli, metric_history, run_id_of, session_processes, start_cli

SLOW = "faults.slow_step_s=0.4"  # steps slow enough to signal mid-run on any machine (numbers unchanged)


def _signal_at(
    work: Path,
    args: list[str],
    at_step: int,
    signals: list[int],
    group: bool = False,
    after: float = 0,
    meanwhile: Callable[[str], None] | None = None,
    ranks: int = 1,
):
    """``python -m pretrain ARGS`` in its own session; ``after`` seconds after step ``at_step`` is logged, send
    ``signals`` one after the other (to the whole process group with ``group``, as a terminal's Ctrl-C); before
    them, ``meanwhile(output so far)``. Returns (exit code, output)."""
    proc = start_cli(work, *args, ranks=ranks, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    out, sent = [], False
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if not sent and re.search(rf"step +{at_step}/", line):
            if meanwhile is not None:
                meanwhile("".join(out))
            time.sleep(after)
            for sig in signals:
                os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
                time.sleep(0.05)
            sent = True
    assert sent, "".join(out)
    return proc.wait(timeout=120), "".join(out)


def _stop_line(output: str) -> str:
    (line,) = [ln for ln in output.splitlines() if ln.startswith(("stopped by", "error:"))]
    return line


def test_ctrl_c_on_ray_workers_commits_a_checkpoint_and_resume_reproduces_the_run(reference, tmp_path):
    """Ctrl-C reaches the driver and Ray's processes; the 2 workers finish the step, commit a checkpoint there, the
    command exits 130 with one line naming it and the resume command, the MLflow run is KILLED with the stop
    recorded; the run resumed (as 2 torchrun ranks: a resume through Ray is ``test_train_e2e.py``'s) repeats the
    uninterrupted run's later steps bitwise."""
    args = ["train", CONFIG, *E2E, SLOW]
    code, out = _signal_at(tmp_path, args, 3, [signal.SIGINT], group=True)
    assert code == 130, out
    line = _stop_line(out)
    m = re.match(r"stopped by SIGINT at step (\d+): checkpoint (\S+); resume: .*\./launch\.sh resume (\w+)$", line)
    assert m, line
    step, ckpt, run_id = int(m.group(1)), Path(m.group(2)), m.group(3)
    assert 3 <= step < 8 and ckpt.name == f"step_{step:08d}" and (ckpt / "manifest.json").is_file()
    assert "Traceback" not in out
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["pretrain.stop.signal"] == "SIGINT" and run.data.tags["pretrain.stop.step"] == str(step)
    assert not (ckpt.parent / "stop_request.json").exists()

    resumed = cli(tmp_path, "resume", run_id, "faults.slow_step_s=0", "cluster.use_ray=false", ranks=2)  # no Ray
    assert f"resumed from {ckpt}" in resumed.stdout
    losses = metric_history(run_id_of(resumed.stdout), uri=uri)
    expected = {s: v for s, v in reference["losses"].items() if s > step}
    assert {s: losses[s] for s in expected} == expected
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FINISHED" and not [k for k in run.data.tags if k.startswith("pretrain.stop.")]


def test_sigterm_to_the_whole_process_group_on_ray_workers_is_a_stop_with_a_checkpoint(tmp_path):
    """`timeout`, `kill -- -PGID` or a scheduler signal every process of the group, the embedded Ray's too: they
    keep running (SIGTERM blocked in them), so the 2 workers commit the stop's checkpoint and the command ends with
    its line (exit 143), not waiting on a Ray that shut down under it."""
    code, out = _signal_at(tmp_path, ["train", CONFIG, *E2E, SLOW], 3, [signal.SIGTERM], group=True)
    assert code == 143, out
    m = re.match(r"stopped by SIGTERM at step (\d+): checkpoint (\S+); resume: ", _stop_line(out))
    assert m and (Path(m.group(2)) / "manifest.json").is_file(), out
    assert "Traceback" not in out


def test_sigterm_to_a_torchrun_launch_stops_every_rank_after_one_step_with_a_checkpoint(tmp_path):
    """torchrun's agent forwards a SIGTERM to every rank: rank 0 acts on it and the other rank stops with it after
    the same step (not killed inside it), so a checkpoint at that step is committed and the run ends KILLED."""
    args = ["train", CONFIG, *E2E, "cluster.use_ray=false", "checkpoint.every_steps=0", "train.max_steps=40", SLOW]
    _, out = _signal_at(tmp_path, args, 3, [signal.SIGTERM], ranks=2)
    m = re.search(r"^stopped by SIGTERM at step (\d+): checkpoint (\S+); resume: .* resume (\w+)$", out, re.M)
    assert m, out[-4000:]
    step, ckpt, run_id = int(m.group(1)), Path(m.group(2)), m.group(3)
    assert 3 <= step < 40 and ckpt.name == f"step_{step:08d}" and (ckpt / "manifest.json").is_file()
    assert json.loads((ckpt / "manifest.json").read_text())["world_size"] == 2
    assert MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).info.status == "KILLED"


def test_sigterm_in_process_then_a_second_signal_stops_at_once(tmp_path):
    """One worker in the command's process: a resume of the run while it trains is refused in one line; SIGTERM
    commits a checkpoint at the step reached (exit 143, KILLED);
    resumed and sent SIGTERM twice, it ends at once (exit 143) naming the latest committed checkpoint, with the MLflow
    run KILLED, not FAILED or left RUNNING."""
    one = [*E2E, "cluster.num_workers=1", "checkpoint.every_steps=0", "train.max_steps=40", SLOW]

    def resume_while_it_trains(out: str) -> None:  # one process trains a run at a time
        running = re.search(r"\[pretrain\] run (\w+):", out).group(1)
        refused = cli(tmp_path, "resume", running, expect=2)
        assert refused.stderr.startswith(f"error: run {running} is training in another process (pid "), refused.stderr
        assert refused.stderr.count("\n") == 1 and "resuming" not in refused.stdout
        run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(running)  # nothing recorded by the refusal
        assert run.info.status == "RUNNING" and "pretrain.data.changed" not in run.data.tags
        config = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").list_artifacts(running, "config")
        assert not [a.path for a in config if a.path.startswith("config/resumed")]

    code, out = _signal_at(tmp_path, ["train", CONFIG, *one], 2, [signal.SIGTERM], meanwhile=resume_while_it_trains)
    assert code == 143, out
    m = re.match(r"stopped by SIGTERM at step (\d+): checkpoint (\S+); resume: .* resume (\w+)$", _stop_line(out))
    assert m, out
    step, ckpt, run_id = int(m.group(1)), Path(m.group(2)), m.group(3)
    assert ckpt.name == f"step_{step:08d}" and step < 40
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "KILLED"

    # both signals while the next step runs (it sleeps 1.5 s first; 1 s after the line, so that a slow end of the
    # step logged is over): the first asks for a stop after that step, the second ends the run before the step is over
    again = ["faults.slow_step_s=1.5", "train.val_every=0"]
    code, out = _signal_at(tmp_path, ["resume", run_id, *again], step + 2, [signal.SIGTERM] * 2, after=1.0)
    assert code == 143, out
    line = _stop_line(out)
    assert line.startswith("error: SIGTERM: stopped at once, no new checkpoint") and str(ckpt) in line, line
    assert "Traceback" not in out
    assert client.get_run(run_id).info.status == "KILLED"
    assert sorted(p.name for p in ckpt.parent.glob("step_*")) == [ckpt.name]


def test_a_stop_while_the_run_is_created_ends_it_killed(tmp_path):
    """SIGTERM while the run is being created in a thread (its MLflow run exists; the faults hook holds its creation
    there) and the embedded Ray starts for 2 workers in the main thread (or has started: which, the machine's speed
    decides): the command ends at once (exit 143) with one line, the run is ``KILLED`` with the stop recorded, not
    left ``RUNNING``, and it never trained; no process of the command's outlives it (Ray's agents would, for a
    minute, after a graceful shutdown of a Ray that had only just started)."""
    proc = start_cli(
        tmp_path,
        "train",
        CONFIG,
        *E2E,
        "faults.slow_run_creation_s=5",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if "the run's creation sleeps 5 s" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    output = "".join(out) + rest
    assert proc.returncode == 143, output
    line = _stop_line(output)
    assert line == "error: SIGTERM: stopped at once; the run has no committed checkpoint, so there is nothing to resume"
    assert "[pretrain] run " not in output and "Traceback" not in output
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "KILLED" and run.data.tags["pretrain.stop.signal"] == "SIGTERM"
    assert "train/loss" not in run.data.metrics
    deadline = time.time() + 10  # SIGKILLed, they may take a moment to leave the process table
    while (left := session_processes(proc.pid)) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, left


def test_a_torchrun_restart_resumes_the_run_its_first_attempt_created(tmp_path):
    """``torchrun --max-restarts 1``: rank 1 dies (SIGKILL) about to run step 5, the agent starts both ranks again,
    and the restarted ``train CONFIG`` resumes the run of the first attempt from its latest committed checkpoint
    (the same MLflow run and directory) instead of a new run from step 0: the steps it trains again give the same
    losses bitwise, and it ends FINISHED at step 6. (The restarted attempt's process groups connect at all only on a
    store of their own: ``pretrain.train.dist.attempt_store``.)"""
    from tests.harness import PYTHON, cli_env

    args = ["train", CONFIG, *E2E, "cluster.use_ray=false", "train.max_steps=6", "faults.kill_worker_at_step=5"]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1"]
    proc = subprocess.run(
        [PYTHON, *launcher, "-m", "pretrain", *args],
        cwd=tmp_path,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert f"a restart of this torchrun launch: resuming its run {run.info.run_id}" in out
    assert run.info.status == "FINISHED" and run.data.tags["pretrain.checkpoint_step"] == "6"
    losses: dict[int, set[float]] = {}
    for m in client.get_metric_history(run.info.run_id, "train/loss"):
        losses.setdefault(m.step, set()).add(m.value)
    assert sorted(losses) == list(range(1, 7)) and all(len(v) == 1 for v in losses.values()), losses
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == [run.info.run_id]
