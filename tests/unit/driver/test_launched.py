"""One run per torchrun launch: which process is which rank, and rank 0's job reaching the other ranks through the
launch's store (rank 0 hosting it, as outside torchrun's agent)."""

from __future__ import annotations

import threading

import pytest

from pretrain.driver.launched import Launch, launched
from pretrain.ports import free_port
from pretrain.train.job import Job

ADDR = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, None),
        ({"WORLD_SIZE": "1", "RANK": "0", **ADDR}, None),
        ({"WORLD_SIZE": "1", "RANK": "0", "TORCHELASTIC_RUN_ID": "r", **ADDR}, Launch(0, 1)),  # its restarts resume
        ({"WORLD_SIZE": "2", "RANK": "1"}, None),  # no rendezvous address: not a launch we can join
        ({"WORLD_SIZE": "two", "RANK": "1", **ADDR}, None),
        ({"WORLD_SIZE": "2", "RANK": "0", **ADDR}, Launch(0, 2)),
        ({"WORLD_SIZE": "4", "RANK": "3", **ADDR}, Launch(3, 4)),
    ],
)
def test_launched_reads_the_rank_from_the_environment(env, want):
    assert launched(env) == want
    if want is not None:
        assert want.leads == (want.rank == 0)


def test_rank_zero_job_reaches_the_other_rank(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    job = Job(config={"name": "x", "train": {"lr": 0.5}}, run_id="abc", run_dir="/runs/abc", startup=[["imports", 1.5]])
    got: dict = {}
    follower = threading.Thread(target=lambda: got.update(Launch(1, 2).receive()))
    follower.start()
    leader = Launch(0, 2)
    leader.publish(job)
    follower.join(timeout=60)
    assert not follower.is_alive()
    assert Job(**got) == job
