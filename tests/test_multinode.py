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

from tests.conftest import PYTHON, ROOT, cli_env
from tests.test_train_e2e import CONFIG, TINY, _losses, _run_id

pytestmark = pytest.mark.slow


def _node_env(tmp_path: Path) -> dict[str, str]:
    env = cli_env(tmp_path)
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # keep every Ray server on 127.0.0.1
               RAY_AUTH_MODE="disabled",  # a throwaway test cluster (token auth is tested in test_cluster)
               RAY_USAGE_STATS_ENABLED="0")
    return env


class LocalCluster:
    """tests/cluster_driver.py in a subprocess: a head node plus nodes added or killed on request."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.env = tmp_path, _node_env(tmp_path)
        self.proc = subprocess.Popen([PYTHON, str(ROOT / "tests" / "cluster_driver.py")], env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(tmp_path / "cluster.log", "w"), text=True,
                                     start_new_session=True)
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


def _on_cluster(cluster: LocalCluster, *args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    proc = subprocess.run([PYTHON, "-m", "pretrain", *args], cwd=cluster.tmp, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _node_ranks(text: str) -> set[str]:
    return set(re.findall(r"rank \d/2 on Ray node \d+ \((\w+)\)", text))


def test_spread_over_two_nodes_matches_single_node(cluster, tmp_path, reference):
    cluster.add_node()
    ref = reference["losses"]  # the same config on an embedded one-node Ray
    spread = _on_cluster(cluster, "train", CONFIG, *TINY, "cluster.placement_strategy=STRICT_SPREAD")
    out = spread.stdout + spread.stderr
    assert len(_node_ranks(out)) == 2, "the two workers must run on two different nodes"
    losses = _losses(tmp_path, _run_id(spread.stdout))
    print("\nsingle node:", ref, "\ntwo nodes:  ", losses)
    assert losses == ref


def test_node_loss_recovers_when_a_node_returns(cluster, tmp_path, reference):
    """Documented behaviour: Ray marks the node dead, the worker group fails, and Train restarts it
    (cluster.max_failures) once resources exist again, from the last committed checkpoint."""
    cluster.add_node()
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    job = subprocess.Popen([PYTHON, "-m", "pretrain", "train", CONFIG, *TINY, "cluster.max_failures=2",
                            "cluster.placement_strategy=STRICT_SPREAD"], cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        run_id = None
        deadline = time.time() + 300
        while time.time() < deadline and job.poll() is None:
            line = job.stdout.readline()
            if line.startswith("[pretrain] run "):
                run_id = line.split()[2].rstrip(":")
            if run_id and (tmp_path / "checkpoints" / run_id / "step_00000004" / "manifest.json").is_file():
                break
        assert run_id and job.poll() is None, "job ended before the node could be killed"
        cluster.kill_node(0)  # the worker node dies (SIGKILL of its raylet and workers)
        cluster.add_node()          # capacity returns
        rest, _ = job.communicate(timeout=400)
        assert job.returncode == 0, rest[-4000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert "resumed from" in rest
    ref = reference["losses"]
    losses = _losses(tmp_path, run_id)
    assert all(losses[s] == ref[s] for s in range(1, 9)), (losses, ref)
