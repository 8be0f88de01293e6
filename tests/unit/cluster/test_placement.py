"""Never a silent wait: a worker layout an embedded local Ray cannot place is refused before Ray starts; on a
cluster the job says what it waits for and ends after ``cluster.start_timeout`` (Ray's placement calls faked here;
the command's refusal is in tests/integration/cluster/test_placement.py, the real cluster in
tests/integration/cluster/test_multinode.py, 3 and 4 workers through Ray in
tests/integration/train/test_lifecycle.py)."""

from __future__ import annotations

import pytest

from cluster import placement
from pretrain.config import ConfigError, load_config
from tests.conftest import ROOT

DEMO = str(ROOT / "configs" / "demo-decoder.yaml")


def test_fractional_cpus_per_worker_and_start_timeout_are_validated():
    cfg = load_config(DEMO, ["cluster.cpus_per_worker=0.5", "cluster.start_timeout=30"])
    assert cfg.cluster.cpus_per_worker == 0.5 and cfg.cluster.start_timeout == 30.0
    assert load_config(ROOT / "configs" / "gpt-125m.yaml").cluster.cpus_per_worker == 8  # whole numbers still load
    for bad, msg in (
        (
            "cluster.cpus_per_worker=1.5",
            "^cluster.cpus_per_worker: Ray reserves a fraction below 1 or a whole number of CPUs, got 1.5$",
        ),
        ("cluster.cpus_per_worker=0", "^cluster.cpus_per_worker: must be > 0"),
        ("cluster.start_timeout=-1", "^cluster.start_timeout: must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=msg):
            load_config(DEMO, [bad])


def test_local_layout_check_applies_to_an_embedded_ray_only(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(placement, "local_cpus", lambda: 2)
    big = load_config(DEMO, ["cluster.num_workers=4"]).cluster
    with pytest.raises(
        ConfigError,
        match=r"need 4 CPUs, but this machine has 2 .* cluster.num_workers=2 or fewer, "
        r"or cluster.cpus_per_worker=0.5 ",
    ):
        placement.check_local_layout(big)
    placement.check_local_layout(load_config(DEMO, ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5"]).cluster)
    placement.check_local_layout(load_config(DEMO, ["cluster.num_workers=4", "cluster.use_ray=false"]).cluster)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # a cluster: it may have (or add) the nodes
    placement.check_local_layout(big)
    # the Jobs API address `submit` takes is no cluster to train on (ray.init rejects it): one line, before anything
    for address in ("http://127.0.0.1:8265", "HTTPS://head:8265"):
        monkeypatch.setenv("RAY_ADDRESS", address)
        with pytest.raises(ConfigError, match=rf"^RAY_ADDRESS={address}: a Jobs API \(dashboard\) address"):
            placement.check_local_layout(load_config(DEMO, ["cluster.num_workers=1"]).cluster)
        # (set for `jobs`/`logs`/`stop`, it does not concern a run that trains in this process)
        placement.check_local_layout(load_config(DEMO, ["cluster.num_workers=2", "cluster.use_ray=false"]).cluster)
    monkeypatch.delenv("RAY_ADDRESS")
    with pytest.raises(ConfigError, match=r"^cluster.address=http://h:8265: a Jobs API"):
        placement.check_local_layout(load_config(DEMO, ["cluster.address=http://h:8265"]).cluster)
    # the local head of `cluster up`: what it offers (submit checks it before sending the job)
    with pytest.raises(ConfigError, match=r"need 4 CPUs, but the local head offers 3 \(cluster up; Ray would wait"):
        placement.check_layout(big, 3, 0, "the local head offers", "cluster up")
    gpu = load_config(DEMO, ["cluster.num_workers=2", "cluster.use_gpu=yes"]).cluster
    with pytest.raises(ConfigError, match=r"^cluster.use_gpu: yes, with 2 workers of one GPU each, but the local head"):
        placement.check_layout(gpu, 8, 1, "the local head offers", "cluster up")
    assert placement.describe_shortfall({"CPU": 1.0}, 3, {"CPU": 2.0}) == (2, "CPU 1")
    assert placement.describe_shortfall({"CPU": 8.0, "GPU": 1.0}, 16, {"CPU": 96.0, "GPU": 8.0}) == (8, "CPU 32, GPU 8")
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
        placement.check_local_layout(
            load_config(DEMO, ["cluster.cpus_per_worker=4", "cluster.ray_for_one_worker=true"]).cluster
        )
