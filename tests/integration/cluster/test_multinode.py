"""A real 2-node Ray cluster on this machine (all on 127.0.0.1): training spread over both nodes gives
the single-node losses; killing a node mid-run recovers once a node comes back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import CONFIG, E2E, PYTHON, cli, cli_env, metric_history, start_cli

DRIVER = Path(__file__).resolve().parent / "cluster_driver.py"


def _node_env(tmp_path: Path) -> dict[str, str]:
    env = cli_env(tmp_path)
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # keep every Ray server on 127.0.0.1
        RAY_AUTH_MODE="disabled",  # a throwaway test cluster (token auth is tested in test_cluster)
        RAY_USAGE_STATS_ENABLED="0",
        # Ray's driver folds log lines that differ only in words with digits ("rank 1/2 on Ray node
        # 1 (…)") into one "[repeated 2x]" line printed up to 5 s later: the test reads every line.
        RAY_DEDUP_LOGS="0",
    )
    return env


class LocalCluster:
    """``cluster_driver.py`` (beside this file) in a subprocess: a head node plus nodes added or killed on request."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.env = tmp_path, _node_env(tmp_path)
        self.proc = subprocess.Popen(
            [PYTHON, str(DRIVER)],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(tmp_path / "cluster.log", "w"),
            text=True,
            start_new_session=True,
        )
        first = self.proc.stdout.readline()
        assert first.startswith("ADDRESS "), first
        self.address = first.split()[1]

    def _cmd(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply.strip() == "OK", f"cluster driver: {text!r} -> {reply!r}"

    def add_node(self) -> None:
        self._cmd("add")

    def kill_node(self, index: int = 0) -> None:
        self._cmd(f"kill {index}")

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except Exception:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(tmp_path)
    try:
        yield c
    finally:
        c.shutdown()


def _node_ranks(text: str) -> set[str]:
    return set(re.findall(r"rank \d/2 on Ray node \d+ \((\w+)\)", text))


def test_two_nodes_match_single_node_and_survive_node_loss(cluster, tmp_path, reference):
    """Never a silent wait: on the 1-CPU head alone, 2 workers on 2 nodes (STRICT_SPREAD) cannot be placed; the job
    says what it waits for and, after cluster.start_timeout, ends with one line (exit 2). Started again, it waits
    (saying so) until a second node joins, then trains. Workers spread over two nodes give the single-node losses
    bitwise. Killing the worker node mid-run (documented behaviour): Ray marks the node dead, the worker group
    fails, and Train restarts it (cluster.max_failures) once capacity exists again, from the last committed
    checkpoint."""
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    spread = [CONFIG, *E2E, "cluster.placement_strategy=STRICT_SPREAD"]
    waiting = (
        "[pretrain] waiting for the cluster to place 2 worker(s) of {CPU: 1} (STRICT_SPREAD): 1/2 fit its "
        "free resources, missing CPU 1; giving up in "
    )
    short = cli(tmp_path, "train", *spread, "cluster.start_timeout=6", expect=2, env=env)
    errors = [ln for ln in short.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1, short.stdout[-2000:] + short.stderr[-2000:]
    assert errors[0].startswith(
        "error: cluster.start_timeout: the cluster placed no group of 2 worker(s) of "
        "{CPU: 1} (STRICT_SPREAD) in 6 s (1/2 fit its free resources; missing CPU 1)"
    ), errors
    assert waiting in short.stdout and "Traceback" not in short.stdout + short.stderr

    job = start_cli(
        tmp_path,
        "train",
        *spread,
        "cluster.max_failures=2",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    early: list[str] = []
    try:
        run_id, added = None, False
        deadline = time.time() + 300
        while time.time() < deadline and job.poll() is None:
            line = job.stdout.readline()
            early.append(line)
            if line.startswith("[pretrain] run "):
                run_id = line.split()[2].rstrip(":")
            if line.startswith(waiting) and not added:
                cluster.add_node()  # the job waits for its second node: it comes
                added = True
            if run_id and (tmp_path / "checkpoints" / run_id / "step_00000004" / "manifest.json").is_file():
                break
        assert added, "the job did not say that it waits for a node:\n" + "".join(early)
        assert any(ln.startswith("[pretrain] the cluster placed 2/2 worker(s) after ") for ln in early), early
        assert run_id and job.poll() is None, "job ended before the node could be killed"
        cluster.kill_node(0)  # the worker node dies (SIGKILL of its raylet and workers)
        cluster.add_node()  # capacity returns
        rest, _ = job.communicate(timeout=400)
        assert job.returncode == 0, rest[-4000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert "resumed from" in rest
    # before and after the loss, the two ranks run on two different nodes
    assert len(_node_ranks("".join(early))) == 2, "the two workers must start on two different nodes"
    ref = reference["losses"]
    losses = metric_history(run_id, uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert all(losses[s] == ref[s] for s in range(1, 9)), (losses, ref)
