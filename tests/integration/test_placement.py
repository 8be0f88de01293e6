"""Never a silent wait: a worker layout an embedded local Ray cannot place is refused before Ray starts; on a
cluster the job says what it waits for and ends after ``cluster.start_timeout`` (fast; the real cluster is in
tests/test_multinode.py, the 1-4 workers through Ray in tests/test_lifecycle.py)."""

from __future__ import annotations

import math
import os
import subprocess
import time
import types

import pytest

from cluster import placement
from pretrain.config import ConfigError, load_config
from tests.conftest import PYTHON, ROOT, cli_env

DEMO = str(ROOT / "configs" / "demo-decoder.yaml")


def test_three_workers_on_two_cpus_are_refused_in_one_line_before_ray_starts(tmp_path):
    """The issue's case (3 one-CPU workers on this 2-core machine; scaled up on a bigger one): exit 2 and one line
    naming what to set, within seconds, before any run, run directory or Ray exists."""
    cpus = os.cpu_count()
    share = 1 if cpus < 3 else cpus // 3 + 1  # 3 x share > cpus
    env = cli_env(tmp_path)
    t0 = time.monotonic()
    proc = subprocess.run([PYTHON, "-m", "pretrain", "train", DEMO, "cluster.num_workers=3",
                           f"cluster.cpus_per_worker={share}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    took = time.monotonic() - t0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    fraction = math.floor(cpus / 3 * 100) / 100
    assert lines[0] == (
        f"error: cluster.num_workers: 3 workers x cluster.cpus_per_worker={share} need {3 * share} CPUs, but this "
        f"machine has {cpus} (an embedded local Ray; Ray would wait forever): set cluster.num_workers={cpus // share} "
        f"or fewer, or cluster.cpus_per_worker={fraction:g} (the workers then share the CPUs)"), lines[0]
    assert "[pretrain] run " not in proc.stdout and not (tmp_path / "checkpoints").exists()
    assert took < 30, f"refused only after {took:.0f} s"
    # what it names is accepted: the suggested fraction places the same 3 workers
    cfg = load_config(DEMO, ["cluster.num_workers=3", f"cluster.cpus_per_worker={fraction:g}"])
    placement.check_local_layout(cfg.cluster)


def test_fractional_cpus_per_worker_and_start_timeout_are_validated():
    cfg = load_config(DEMO, ["cluster.cpus_per_worker=0.5", "cluster.start_timeout=30"])
    assert cfg.cluster.cpus_per_worker == 0.5 and cfg.cluster.start_timeout == 30.0
    assert load_config(ROOT / "configs" / "gpt-125m.yaml").cluster.cpus_per_worker == 8  # whole numbers still load
    for bad, msg in (("cluster.cpus_per_worker=1.5", "^cluster.cpus_per_worker: Ray reserves a fraction below 1 or "
                                                     "a whole number of CPUs, got 1.5$"),
                     ("cluster.cpus_per_worker=0", "^cluster.cpus_per_worker: must be > 0"),
                     ("cluster.start_timeout=-1", "^cluster.start_timeout: must be >= 0")):
        with pytest.raises(ConfigError, match=msg):
            load_config(DEMO, [bad])


def test_local_layout_check_applies_to_an_embedded_ray_only(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(placement, "local_cpus", lambda: 2)
    big = load_config(DEMO, ["cluster.num_workers=4"]).cluster
    with pytest.raises(ConfigError, match=r"need 4 CPUs, but this machine has 2 .* cluster.num_workers=2 or fewer, "
                                          r"or cluster.cpus_per_worker=0.5 "):
        placement.check_local_layout(big)
    placement.check_local_layout(load_config(DEMO, ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5"]).cluster)
    placement.check_local_layout(load_config(DEMO, ["cluster.num_workers=4", "cluster.use_ray=false"]).cluster)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a cluster: it may have (or add) the nodes
    placement.check_local_layout(big)
    assert placement.describe_shortfall({"CPU": 1.0}, 3, {"CPU": 2.0}) == (2, "CPU 1")
    assert placement.describe_shortfall({"CPU": 8.0, "GPU": 1.0}, 16, {"CPU": 96.0, "GPU": 8.0}) == \
        (8, "CPU 32, GPU 8")
    assert placement.describe_shortfall({"CPU": 1.0}, 2, {"CPU": 2.0})[1].startswith("no resource in total")


def test_one_worker_trains_in_process_unless_ray_has_something_to_do(monkeypatch):
    """One worker, no cluster, no restarts: the command's own process trains (Ray would place, connect and restart
    nothing); anything Ray is for — more workers, a cluster address or RAY_ADDRESS, restarts — or
    ``cluster.ray_for_one_worker=true`` goes through Ray Train; ``use_ray=false`` is in-process whatever else."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def in_process(*overrides: str) -> bool:
        return load_config(DEMO, list(overrides)).cluster.trains_in_process()

    assert in_process()  # the demo: one worker
    assert not in_process("cluster.num_workers=2")
    assert not in_process("cluster.address=127.0.0.1:6379")
    assert not in_process("cluster.max_failures=1")
    assert not in_process("cluster.ray_for_one_worker=true")
    assert in_process("cluster.use_ray=false", "cluster.num_workers=2", "cluster.ray_for_one_worker=true")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert not in_process()
    assert load_config(DEMO, []).cluster.trains_in_process(ray_address="")
    monkeypatch.delenv("RAY_ADDRESS")
    placement.check_local_layout(load_config(DEMO, ["cluster.cpus_per_worker=4"]).cluster)  # no Ray: no placement
    with pytest.raises(ConfigError, match="cluster.cpus_per_worker"):
        placement.check_local_layout(load_config(DEMO, ["cluster.cpus_per_worker=4",
                                                         "cluster.ray_for_one_worker=true"]).cluster)


class _FakeRay:
    """Ray's placement-group calls on a cluster that places the group once ``place_at`` (fake) seconds passed."""

    def __init__(self, place_at: float):
        self.now, self.place_at, self.removed = 0.0, place_at, 0

    def wait(self, refs, timeout):
        self.now += timeout
        return (refs if self.now >= self.place_at else []), []

    def available_resources(self):
        return {"CPU": 2.0}


def test_a_cluster_job_says_what_it_waits_for_and_ends_after_start_timeout(monkeypatch):
    """On a cluster the job reports placed / wanted workers and the missing resources every few seconds, and
    ends with one line (a ConfigError: exit 2) after cluster.start_timeout; placed in time, it says so."""
    import importlib

    import ray

    pg_mod = importlib.import_module("ray.util.placement_group")  # (ray.util.placement_group is also a function)

    def run(place_at: float, timeout: float) -> tuple[list[str], float | Exception]:
        fake = _FakeRay(place_at)
        monkeypatch.setattr(ray, "wait", fake.wait)
        monkeypatch.setattr(ray, "available_resources", fake.available_resources)
        monkeypatch.setattr(pg_mod, "placement_group", lambda bundles, strategy: types.SimpleNamespace(
            ready=lambda: "ref", bundles=bundles, strategy=strategy))
        monkeypatch.setattr(pg_mod, "remove_placement_group", lambda pg: setattr(fake, "removed", fake.removed + 1))
        cluster = load_config(DEMO, ["cluster.num_workers=3", f"cluster.start_timeout={timeout}"]).cluster
        said: list[str] = []
        try:
            out = placement.wait_for_placement(cluster, use_gpu=False, say=said.append, clock=lambda: fake.now)
        except ConfigError as e:
            out = e
        assert fake.removed == 1, "the probe's placement group is always removed"
        return said, out

    said, err = run(place_at=1e9, timeout=40)
    assert isinstance(err, placement.PlacementError) and isinstance(err, ConfigError)
    assert str(err) == ("cluster.start_timeout: the cluster placed no group of 3 worker(s) of {CPU: 1} (PACK) in 40 s "
                        "(2/3 fit its free resources; missing CPU 1): free resources, or set fewer "
                        "cluster.num_workers, a smaller cluster.cpus_per_worker or a longer cluster.start_timeout")
    assert len(said) == 3, said  # at the start, then every 15 s
    assert said[0] == ("[pretrain] waiting for the cluster to place 3 worker(s) of {CPU: 1} (PACK): 2/3 fit its free "
                       "resources, missing CPU 1; giving up in 38 s (cluster.start_timeout)")
    said, waited = run(place_at=7, timeout=40)
    assert waited == pytest.approx(8.0) and said[-1] == "[pretrain] the cluster placed 3/3 worker(s) after 8 s"
    said, waited = run(place_at=0, timeout=40)
    assert said == [] and waited == 2.0, "placed at once: no line"
    said, waited = run(place_at=100, timeout=0)
    assert waited >= 100 and "waiting on (cluster.start_timeout=0)" in said[0], "0 waits without limit"
