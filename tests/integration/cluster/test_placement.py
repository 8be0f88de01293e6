"""Never a silent wait, through the command line: a worker layout an embedded local Ray cannot place is refused in
one line before Ray starts."""

from __future__ import annotations

import math
import os
import time
import types

import pytest

from cluster import placement
from pretrain.config import ConfigError, load_config
from tests.conftest import cli_env
from tests.harness import cli
from tests.unit.cluster.test_placement import DEMO


def test_three_workers_on_two_cpus_are_refused_in_one_line_before_ray_starts(tmp_path):
    """3 one-CPU workers on a 2-core machine (scaled up on a bigger one): exit 2 and one line
    naming what to set, within seconds, before any run, run directory or Ray exists."""
    cpus = os.cpu_count()
    share = 1 if cpus < 3 else cpus // 3 + 1  # 3 x share > cpus
    env = cli_env(tmp_path)
    t0 = time.monotonic()
    proc = cli(
        tmp_path,
        "train",
        DEMO,
        "cluster.num_workers=3",
        f"cluster.cpus_per_worker={share}",
        expect=2,
        timeout=120,
        env=env,
    )
    took = time.monotonic() - t0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stdout + proc.stderr
    fraction = math.floor(cpus / 3 * 100) / 100
    assert lines[0] == (
        f"error: cluster.num_workers: 3 workers x cluster.cpus_per_worker={share} need {3 * share} CPUs, but this "
        f"machine has {cpus} (an embedded local Ray; Ray would wait forever): set cluster.num_workers={cpus // share} "
        f"or fewer, or cluster.cpus_per_worker={fraction:g} (the workers then share the CPUs)"
    ), lines[0]
    assert "[pretrain] run " not in proc.stdout and not (tmp_path / "checkpoints").exists()
    assert took < 30, f"refused only after {took:.0f} s"
    # what it names is accepted: the suggested fraction places the same 3 workers
    cfg = load_config(DEMO, ["cluster.num_workers=3", f"cluster.cpus_per_worker={fraction:g}"])
    placement.check_local_layout(cfg.cluster)


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
        monkeypatch.setattr(
            pg_mod,
            "placement_group",
            lambda bundles, strategy: types.SimpleNamespace(ready=lambda: "ref", bundles=bundles, strategy=strategy),
        )
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
    assert str(err) == (
        "cluster.start_timeout: the cluster placed no group of 3 worker(s) of {CPU: 1} (PACK) in 40 s "
        "(2/3 fit its free resources; missing CPU 1): free resources, or set fewer "
        "cluster.num_workers, a smaller cluster.cpus_per_worker or a longer cluster.start_timeout"
    )
    assert len(said) == 3, said  # at the start, then every 15 s
    assert said[0] == (
        "[pretrain] waiting for the cluster to place 3 worker(s) of {CPU: 1} (PACK): 2/3 fit its free "
        "resources, missing CPU 1; giving up in 38 s (cluster.start_timeout)"
    )
    said, waited = run(place_at=7, timeout=40)
    assert waited == pytest.approx(8.0) and said[-1] == "[pretrain] the cluster placed 3/3 worker(s) after 8 s"
    said, waited = run(place_at=0, timeout=40)
    assert said == [] and waited == 2.0, "placed at once: no line"
    said, waited = run(place_at=100, timeout=0)
    assert waited >= 100 and "waiting on (cluster.start_timeout=0)" in said[0], "0 waits without limit"
