"""The quiet console of a training run with other processes: a child's output and a leaked copy of the pipe, Ray
started beside a failing preparation, and a real run through the CLI and Ray (only user lines on the terminal,
damaged checkpoints refused in one line)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from pretrain.driver.console import QuietConsole
from tests.harness import CONFIG, E2E, cli, metric_history, run_id_of


def test_quiet_console_keeps_everything_in_the_log(tmp_path, capfd):
    log = tmp_path / "logs" / "driver.log"
    with QuietConsole(log, verbose=False):
        os.write(1, b"[train] hello\n")
        os.write(2, b"internal noise\n")  # (pytest's capfd takes sys.stderr itself; a real run's goes to fd 2)
        os.write(2, b"\x1b[36m(RayTrainWorker pid=12)\x1b[0m [train] from a worker\n")
        subprocess.run(["sh", "-c", "echo child noise; echo '[pretrain] child line' >&2"], check=True)
    print("[pretrain] after the block", flush=True)
    out, err = capfd.readouterr()
    assert out.splitlines() == [
        "[train] hello",
        "[train] from a worker",
        "[pretrain] child line",
        "[pretrain] after the block",
    ]
    assert "noise" not in out + err
    text = log.read_text()
    for line in ("[train] hello", "internal noise", "(RayTrainWorker pid=12)", "child noise", "[pretrain] child line"):
        assert line in text, line
    assert "after the block" not in text


def test_a_leaked_copy_of_the_pipe_does_not_hold_the_end(tmp_path, capfd):
    """A descriptor duplicated from stderr inside the block and never closed (DeepSpeed's op probe does this in
    an in-process run), or a child process still holding the pipe, does not keep the block waiting for the pipe's
    end: the block ends at once, with every line written before the end (a last line without a newline included),
    and the pump thread is gone."""
    log = tmp_path / "logs" / "driver.log"
    leaked = None
    child = None
    try:
        with QuietConsole(log, verbose=False) as console:
            leaked = os.dup(2)
            child = subprocess.Popen(["sleep", "30"])  # inherits fds 1 and 2: the pipe
            os.write(1, b"[train] last line\n")
            os.write(2, b"no newline at the end")
            t0 = time.monotonic()
        took = time.monotonic() - t0
    finally:
        if child is not None:
            child.kill()
            child.wait()
        if leaked is not None:
            os.close(leaked)
    assert took < 1.0, took
    assert not console._thread.is_alive()
    out, _ = capfd.readouterr()
    assert out.splitlines() == ["[train] last line"]
    assert log.read_text() == "[train] last line\nno newline at the end"


def test_a_failed_preparation_stops_the_ray_it_started_and_is_the_error():
    """``prepare_while_ray_starts``: the run's preparation fails (a user error) while Ray starts in this thread:
    that error is raised and the Ray started for it is shut down (the success path: every CLI test through Ray)."""
    import ray

    from cluster.launch import prepare_while_ray_starts
    from cluster.ray_process import stop_ray
    from pretrain.config import ConfigError, load_config

    cluster = load_config(None, []).cluster

    def bad():
        time.sleep(0.5)
        raise ConfigError("data.sources[0]: not text")

    try:
        with pytest.raises(ConfigError, match="not text"):
            prepare_while_ray_starts(cluster, bad)
        assert not ray.is_initialized()
    finally:
        stop_ray(ray.is_initialized())


def test_quiet_run_damaged_checkpoint_and_worker_side_user_error(tmp_path):
    """Through the CLI and Ray: the terminal shows only our lines and the full log lands in the run directory; a
    damaged newest checkpoint is refused before Ray in one line that names the newest good one, and resuming
    from that one as the line says works and reproduces the original losses; a damaged checkpoint found by a
    worker (checkpoint.resume_from, one byte changed at the same size, which only hashing finds) is also one line,
    exit 2, no traceback, and ends the run at once, restarts allowed or not (``cluster.max_failures``)."""
    opts = [o for o in E2E if not o.startswith(("train.max_steps", "cluster.num_workers"))]
    opts += ["train.max_steps=4", "cluster.num_workers=1", "cluster.ray_for_one_worker=true"]  # through Ray

    first = cli(tmp_path, "train", CONFIG, *opts, expect=0)
    ours = ("[pretrain]", "[train]", "==", "  ", "")
    assert all(line.startswith(ours) for line in first.stdout.splitlines()), first.stdout
    assert first.stderr.strip() == "", first.stderr
    run_id = run_id_of(first.stdout)
    run_dir = tmp_path / "checkpoints" / run_id
    log = (run_dir / "logs" / "driver.log").read_text()
    assert f"full log (Ray, DeepSpeed, every worker): {run_dir / 'logs' / 'driver.log'}" in first.stdout
    # step 2, not the last one: Ray forwards worker lines asynchronously and may drop the last ones at shutdown
    assert "(RayTrainWorker pid=" in log and "[train] checkpoint committed: step 2" in log

    with open(run_dir / "step_00000004" / "data" / "rank_0.json", "ab") as f:
        f.write(b" ")  # damaged after commit
    t0 = time.time()
    refused = cli(tmp_path, "resume", run_id, "train.max_steps=6", expect=2)
    good = run_dir / "step_00000002"
    assert time.time() - t0 < 30, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"error: {run_dir / 'step_00000004'}: checksum mismatch for data/rank_0.json; the newest checkpoint that "
        f"verifies is step 2: resume from it with ./launch.sh resume {good}"
    ]
    assert "Ray" not in refused.stdout, "refused before Ray started"
    for command in (["export", run_id, "--out", str(tmp_path / "hf")], ["eval", run_id]):  # by run id, too
        refused = cli(tmp_path, *command, expect=2)
        errors = [line for line in refused.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "checksum mismatch for data/rank_0.json" in errors[0], refused.stderr
        assert errors[0].endswith(f"the newest checkpoint that verifies is step 2: {good}"), errors[0]
    assert not (tmp_path / "hf").exists()

    damaged = run_dir / "step_00000004" / "data" / "rank_0.json"
    text = damaged.read_bytes()[:-1]  # as committed, then one byte changed: only hashing sees it, in the worker
    damaged.write_bytes(text[:-1] + (b"x" if text[-1:] != b"x" else b"y"))
    restarts = ("cluster.max_failures=2", "train.max_steps=6", f"checkpoint.resume_from={run_dir / 'step_00000004'}")
    in_worker = cli(tmp_path, "train", CONFIG, *opts, *restarts, expect=2)
    assert "Traceback" not in in_worker.stdout + in_worker.stderr
    errors = [line for line in in_worker.stderr.splitlines() if line.strip()]
    assert (
        len(errors) == 1
        and errors[0].startswith("error: ")
        and "newest checkpoint that verifies is step 2" in errors[0]
    ), in_worker.stderr
    (forked,) = [d for d in (tmp_path / "checkpoints").iterdir() if d.name not in (run_id, "_ray")]
    attempts = (forked / "logs" / "driver.log").read_text().count("[train] rank 0/1 on Ray node")
    assert attempts == 1, f"a user error ended the run at once, not after restarts: {attempts} attempts"

    # What the message says (a new run from step 2: 4 steps), in this process: the Ray path is the first run's.
    again = cli(tmp_path, "resume", str(good), "cluster.ray_for_one_worker=false", expect=0)
    assert "resumed from" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ref, new = metric_history(run_id, uri=uri), metric_history(run_id_of(again.stdout), uri=uri)
    assert sorted(new) == [3, 4] and all(new[s] == ref[s] for s in (3, 4)), (ref, new)
