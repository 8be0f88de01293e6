"""Cluster jobs through the command line: the local Ray head (`cluster up|down|status`) and the Jobs API client
(`submit`, `jobs`, `status`, `logs`, `stop`), without a head (one-line errors) and against a real one.

The tests against a head share one real Ray head (127.0.0.1, token auth, own temp dir and state dir) for the module
and stop exactly its processes afterwards, also when a test fails."""

from __future__ import annotations

import json
import re
import shutil
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from pretrain.train.dist import free_port as _free_port
from tests.conftest import ROOT, cli_env
from tests.harness import cli, start_cli, tiny_model
from tests.unit.cluster.test_submit import _CLIENT_ENV_DROP

CONFIG = str(ROOT / "configs" / "demo-decoder.yaml")
TINY = [
    *tiny_model(num_layers=1, num_heads=2, num_kv_heads=0, max_seq_len=32, vocab_size=None),
    "data.tokenizer_vocab_size=300",
    "data.tokenizer_train_docs=500",
    "data.num_streams=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.max_steps=3",
    "train.val_sequences=4",
    "checkpoint.every_steps=0",
    "cluster.num_workers=1",
]

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _env(work: Path, head_dir: Path, **extra: str) -> dict[str, str]:
    env = cli_env(work)
    for k in _CLIENT_ENV_DROP:
        env.pop(k, None)
    env["PRETRAIN_RAY_HEAD_DIR"] = str(head_dir)
    env.update(extra)
    return env


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    return lines[0]


def test_bad_config_exits_2_before_contacting_anything(tmp_path):
    env = _env(tmp_path, tmp_path / "head")
    port = _free_port()  # nothing listens there: had submit tried to send, it would say "cannot reach"
    proc = cli(
        tmp_path,
        "submit",
        "--address",
        f"http://127.0.0.1:{port}",
        CONFIG,
        "model.num_layerz=2",
        expect=2,
        timeout=120,
        env=env,
    )
    assert "model.num_layerz" in _one_error_line(proc)
    proc = cli(
        tmp_path,
        "submit",
        "--address",
        f"http://127.0.0.1:{port}",
        CONFIG,
        "train.max_steps=-1",
        expect=2,
        timeout=120,
        env=env,
    )
    assert "train.max_steps" in _one_error_line(proc)


@pytest.mark.parametrize(
    "cmd",
    [["jobs"], ["status", "raysubmit_x"], ["logs", "raysubmit_x"], ["stop", "raysubmit_x"], ["submit", CONFIG, *TINY]],
)
def test_unreachable_address_is_one_line(tmp_path, cmd):
    env = _env(tmp_path, tmp_path / "head")
    port = _free_port()
    proc = cli(tmp_path, *cmd, "--address", f"http://127.0.0.1:{port}", expect=1, timeout=120, env=env)
    line = _one_error_line(proc)
    assert line.startswith("error: cannot reach the Ray Jobs API at http://127.0.0.1:") and str(port) in line


def test_cluster_down_and_status_without_a_head(tmp_path):
    env = _env(tmp_path, tmp_path / "head")
    proc = cli(tmp_path, "cluster", "down", expect=0, timeout=120, env=env)
    assert "nothing to stop" in proc.stdout
    proc = cli(tmp_path, "cluster", "status", expect=1, timeout=120, env=env)
    assert "no local Ray head" in proc.stdout


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """`cluster up` in a private state dir and temp dir; always torn down (only its own processes)."""
    from cluster import head as head_mod

    work = tmp_path_factory.mktemp("cluster")
    head_dir = work / "head"
    temp_dir = f"/tmp/prt-{uuid.uuid4().hex[:8]}"  # short: Ray's socket paths must stay < 107 chars
    port = _free_port()
    env = _env(work, head_dir)
    state = None
    try:
        proc = cli(
            work,
            "cluster",
            "up",
            "--dashboard-port",
            str(port),
            "--temp-dir",
            temp_dir,
            "--num-cpus",
            "2",
            expect=0,
            timeout=240,
            env=env,
        )
        state = json.loads((head_dir / "state.json").read_text())
        yield {
            "work": work,
            "env": env,
            "state": state,
            "address": state["address"],
            "head_dir": head_dir,
            "up_stdout": proc.stdout,
        }
    finally:
        if state is None and (head_dir / "state.json").is_file():
            state = json.loads((head_dir / "state.json").read_text())
        try:
            cli(work, "cluster", "down", "--grace", "3", expect=None, timeout=120, env=env)
        finally:
            if state:  # whatever survived `down` (it should be nothing): kill it, by session / temp dir
                import psutil

                left = head_mod.head_processes(state)
                for p in left:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                assert not left, f"cluster down left {len(left)} processes"
            shutil.rmtree(temp_dir, ignore_errors=True)


def _listeners(state: dict) -> list[tuple[str, int, str]]:
    import psutil

    from cluster.head import head_processes

    out = []
    for p in head_processes(state):
        try:
            name = p.name()
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                    out.append((c.laddr.ip, c.laddr.port, name))
        except psutil.Error:
            continue
    return out


def _watch(head: dict, job_id: str, done, timeout: float) -> tuple[str, str]:
    """Poll a job through the Jobs API in this process until ``done(status, logs)``; returns both (no process per
    poll; the CLI's ``status`` and ``logs`` are each tested as users run them)."""
    from ray.job_submission import JobSubmissionClient

    token = Path(head["state"]["token_path"]).read_text().strip()
    client = JobSubmissionClient(head["address"], headers={"Authorization": f"Bearer {token}"})
    deadline = time.time() + timeout
    while True:
        status, logs = str(client.get_job_status(job_id).value), client.get_job_logs(job_id)
        if done(status, logs):
            return status, logs
        assert time.time() < deadline, f"job {job_id} still {status} after {timeout} s:\n{logs[-3000:]}"
        time.sleep(1)


def _ended(status: str, logs: str) -> bool:
    return status in ("SUCCEEDED", "FAILED", "STOPPED")


def _training(status: str, logs: str) -> bool:
    """The job has ended, or its workers are up and have taken a step."""
    return _ended(status, logs) or "[train] step" in logs


def test_head_is_local_only_and_authenticated(head):
    state, work, env = head["state"], head["work"], head["env"]
    assert state["address"].startswith("http://127.0.0.1:")
    token_file = Path(state["token_path"])
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(state["temp_dir"]).stat().st_mode) == 0o700  # Ray's logs hold the jobs' environments
    assert token_file.read_text().strip() not in head["up_stdout"]

    found = _listeners(state)
    names = {n for _, _, n in found}
    assert {"gcs_server", "raylet"} <= names, names
    wide = [x for x in found if x[0] not in LOOPBACK]
    print("\nlisteners of the idle head:", sorted(found))
    assert not wide, f"listening beyond loopback: {wide}"

    # no token / wrong token: HTTP 401 / 403 at the Jobs API, one line from the CLI
    for headers, code in (({}, 401), ({"Authorization": "Bearer " + "0" * 64}, 403)):
        req = urllib.request.Request(state["address"] + "/api/jobs/", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == code
    # a client with no token at all (no local-head state, empty HOME), or a wrong one
    bare = _env(work, work / "no-head", HOME=str(work / "home"))
    wrong = {**bare, "RAY_AUTH_TOKEN": "wrong-token"}
    proc = cli(work, "jobs", "--address", state["address"], expect=1, timeout=120, env=wrong)
    line = _one_error_line(proc)
    assert line.startswith("error: authentication failed at ") and "wrong-token" not in line
    # a token set for another cluster: the running local head's own is sent to it
    cli(work, "jobs", expect=0, timeout=120, env={**env, "RAY_AUTH_TOKEN": "wrong-token"})
    proc = cli(work, "status", "raysubmit_x", "--address", state["address"], expect=1, timeout=120, env=bare)
    assert "authentication failed" in _one_error_line(proc)

    proc = cli(work, "cluster", "status", expect=0, timeout=120, env=env)
    assert "alive" in proc.stdout and "CPU" in proc.stdout
    proc = cli(work, "cluster", "up", expect=0, timeout=120, env=env)  # idempotent
    assert "already running" in proc.stdout


def test_submit_tiny_job_end_to_end(head):
    work, env = head["work"], head["env"]
    before = cli(work, "jobs", expect=0, timeout=120, env=env)
    bad = cli(work, "submit", CONFIG, *TINY, "model.hidden_size=oops", expect=2, timeout=120, env=env)
    assert "model.hidden_size" in _one_error_line(bad)
    big = cli(work, "submit", CONFIG, *TINY, "cluster.cpus_per_worker=512", expect=2, timeout=120, env=env)
    assert "CPUs, but the local head offers " in _one_error_line(big)  # not a job waiting 600 s to fail
    after = cli(work, "jobs", expect=None, timeout=120, env=env)
    assert after.stdout.count("raysubmit_") == before.stdout.count("raysubmit_")  # nothing sent

    proc = cli(work, "submit", CONFIG, *TINY, expect=0, timeout=240, env=env)
    lines = proc.stdout.splitlines()
    m_job = re.fullmatch(r"job id: (raysubmit_\w+)", lines[0])
    m_run = re.fullmatch(r"MLflow run id: ([0-9a-f]{32})", lines[1])
    assert m_job and m_run, proc.stdout
    job_id, run_id = m_job.group(1), m_run.group(1)

    status, logs = _watch(head, job_id, _ended, 300)
    assert status == "SUCCEEDED", logs[-3000:]
    assert cli(work, "status", job_id, expect=0, timeout=120, env=env).stdout.strip() == "SUCCEEDED"
    logs = cli(work, "logs", job_id, expect=0, timeout=120, env=env)
    assert "== finished: demo-decoder ==" in logs.stdout and re.search(rf"MLflow run id\s+{run_id}", logs.stdout)
    assert "Found multiple active Ray instances" not in logs.stdout  # Ray's actors know their cluster
    follow = cli(work, "logs", job_id, "--follow", expect=0, timeout=60, env=env)  # a finished job: prints and returns
    assert "== finished" in follow.stdout
    jobs = cli(work, "jobs", expect=None, timeout=120, env=env)
    assert re.search(rf"{job_id}\s+SUCCEEDED", jobs.stdout), jobs.stdout
    verbose = cli(work, "status", "-v", job_id, expect=None, timeout=120, env=env)
    assert verbose.stdout.splitlines()[0] == "SUCCEEDED" and "-m pretrain train _pretrain_job.yaml" in verbose.stdout

    # the run went to the test's MLflow store, its checkpoint next to the submitting cwd
    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"]).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert (work / "checkpoints" / run_id / "step_00000003" / "manifest.json").is_file()
    cli(work, "status", "raysubmit_nosuchjob", expect=1, timeout=120, env=env)


def test_stop_running_job_and_listeners_while_training(head):
    work, env, state = head["work"], head["env"], head["state"]
    long = [a for a in TINY if not a.startswith("train.max_steps")] + ["train.max_steps=2000"]
    proc = cli(work, "submit", CONFIG, *long, expect=0, timeout=240, env=env)
    job_id = re.match(r"job id: (\S+)", proc.stdout).group(1)
    assert "MLflow run id: " in proc.stdout

    status, logs = _watch(head, job_id, _training, 180)
    assert status == "RUNNING", logs[-3000:]
    found = _listeners(state)
    wide = [x for x in found if x[0] not in LOOPBACK]
    print("\nlisteners while a job trains:", sorted(found))
    print("beyond loopback:", wide)
    # The only one: torch.distributed's TCPStore (rendezvous) in the rank-0 training worker, which PyTorch
    # always binds on all interfaces. Every Ray listener stays on 127.0.0.1.
    assert all(name.startswith("ray::RayTrainWorker") for _, _, name in wide), wide
    assert len(wide) <= 1, wide

    follower = start_cli(work, "logs", job_id, "--follow", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(3)
        assert follower.poll() is None  # still following a running job
        stop = cli(work, "stop", job_id, expect=None, timeout=120, env=env)
        out, err = follower.communicate(timeout=60)  # the stream ends with the job
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0 and "[pretrain] run " in out and "Traceback" not in err, err
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert stop.stdout.strip().endswith("STOPPED")
    assert cli(work, "status", job_id, expect=None, timeout=120, env=env).stdout.strip() == "STOPPED"
    # the stop was a checkpoint: the driver got SIGTERM from Ray Jobs, the worker finished its step and committed it
    run_id = re.search(r"MLflow run id: (\w+)", proc.stdout).group(1)
    m = re.search(r"stopped by SIGTERM at step (\d+): checkpoint (\S+); resume: ", out)
    assert m, out[-3000:]
    assert Path(m.group(2)).name == f"step_{int(m.group(1)):08d}" and (Path(m.group(2)) / "manifest.json").is_file()
    from mlflow import MlflowClient

    run = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"]).get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["pretrain.stop.signal"] == "SIGTERM"
    again = cli(work, "stop", job_id, expect=0, timeout=120, env=env)
    assert "already ended: STOPPED" in again.stdout


def test_job_failing_on_the_cluster_is_one_line(head):
    work, env = head["work"], head["env"]
    # valid config, but the data does not exist where the job runs: the driver fails before a run starts
    proc = cli(
        work,
        "submit",
        CONFIG,
        *TINY,
        "data.sources=[{path: /nonexistent/corpus.jsonl}]",
        expect=1,
        timeout=240,
        env=env,
    )
    job_id = re.match(r"job id: (\S+)", proc.stdout).group(1)
    line = _one_error_line(proc)
    assert line.startswith(f"error: job {job_id} FAILED") and "/nonexistent/corpus.jsonl" in line, line
    assert cli(work, "status", job_id, expect=None, timeout=120, env=env).stdout.strip() == "FAILED"


def test_cluster_down_stops_a_running_job_with_a_checkpoint_first(head):
    """Last in this file (the head is gone after it): `cluster down` while a job trains stops the job as `stop`
    does, so the run commits a checkpoint and ends KILLED, instead of dying with the head and staying RUNNING."""
    from mlflow import MlflowClient

    work, env = head["work"], head["env"]
    long = [a for a in TINY if not a.startswith("train.max_steps")] + ["train.max_steps=2000"]
    proc = cli(work, "submit", CONFIG, *long, expect=0, timeout=240, env=env)
    job_id = re.match(r"job id: (\S+)", proc.stdout).group(1)
    run_id = re.search(r"MLflow run id: (\w+)", proc.stdout).group(1)
    status, logs = _watch(head, job_id, _training, 180)
    assert status == "RUNNING", logs[-3000:]
    down = cli(work, "cluster", "down", expect=0, timeout=240, env=env)
    assert "stopping 1 running job(s) first" in down.stdout and f"job {job_id}: STOPPED" in down.stdout, down.stdout
    run = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"]).get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["pretrain.stop.signal"] == "SIGTERM"
    assert (Path(run.data.tags["pretrain.stop.checkpoint"]) / "manifest.json").is_file()
