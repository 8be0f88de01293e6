"""Asynchronous checkpoint save on two real gloo ranks (ZeRO-2): the background write produces the bytes a
synchronous save writes, training goes on meanwhile, the commit is decided at a step boundary identically on every
rank, a second save waits for the one in flight, and the summary and metrics record each save."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store as ck
from tests.harness import run_distributed
from tests.unit.checkpoint.test_snapshot import _digests


class _Tracker:
    run_id = "r"

    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict]] = []

    def register_checkpoint(self, path, manifest) -> None:
        pass

    def log_metrics(self, metrics, step) -> None:
        self.metrics.append((step, dict(metrics)))


class _Batches:
    def state_dict(self) -> dict:
        return {"streams": {}}


def _engine_saves(rank: int, world: int, work: str) -> dict:
    """Two ranks, ZeRO-2: a synchronous save of step 1 in one run directory, an asynchronous one of the same state
    in another; training goes on while it is written (slowed by the fault hook), it is committed at the first step
    boundary where both ranks are done (the same step on both ranks); a second async save waits for the first."""
    from dataclasses import replace

    from pretrain.train import dist
    from pretrain.train.checkpointer import Checkpointer
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step
    from pretrain.train.trainer import TrainerState as _State
    from tests.integration.checkpoint.test_hashing import tiny_zero2_config

    torch.set_num_threads(1)
    work_dir = Path(work)
    cfg = tiny_zero2_config(
        work_dir, "faults.slow_checkpoint_at_step=1", f"faults.slow_checkpoint_s={0.5 + 1.5 * rank}"
    )
    module = build_module(cfg)

    def step(i: int) -> float:
        ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(10 * i + rank))
        return run_step(module, StepInput(i + 1, {"input_ids": ids, "labels": ids}, module.lr_at(i))).loss

    step(0)
    ctx = dist.DistContext(rank, world, rank, world, torch.device("cpu"), False)
    sync_cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, async_=False))
    sync_path = Checkpointer(sync_cfg, work_dir / "sync", ctx, _Tracker()).save(module, _Batches(), _State(step=1))
    tracker = _Tracker()
    ckpt = Checkpointer(cfg, work_dir / "async", ctx, tracker)
    t0 = time.perf_counter()
    path = ckpt.save(module, _Batches(), _State(step=1))
    stall = time.perf_counter() - t0
    in_flight_while_training, committed_at = [], None
    for i in range(1, 1000):
        step(i)  # mutates the ZeRO partitions and moments in place
        time.sleep(0.02)
        in_flight_while_training.append(not ck.list_committed(work_dir / "async"))
        if ckpt.poll() is not None:
            committed_at = i
            break
    second = ckpt.save(module, _Batches(), _State(step=committed_at + 1))
    step(committed_at + 1)
    ckpt.save(module, _Batches(), _State(step=committed_at + 2))  # the second is still in flight: this waits for it
    waited = [c.step for c in ck.list_committed(work_dir / "async")]
    ckpt.finish()
    return {
        "waited": waited,
        "sync": str(sync_path),
        "async": str(path),
        "committed_at": committed_at,
        "stall": stall,
        "while": in_flight_while_training,
        "second": str(second),
        "summary": ckpt.summary(),
        "metrics": tracker.metrics,
    }


def test_async_engine_save_is_bitwise_the_sync_save_and_commits_at_one_step(tmp_path):
    results = run_distributed(_engine_saves, 2, str(tmp_path), timeout=900, fresh=False)
    r0, r1 = results
    sync, asyn = Path(r0["sync"]), Path(r0["async"])
    assert asyn == tmp_path / "async" / ly.step_dir_name(1)
    digests_sync, digests_async = _digests(sync), _digests(asyn)
    assert sorted(digests_async) == sorted(digests_sync)
    assert any("zero_pp_rank_1_" in rel and "optim" in rel for rel in digests_async)
    different = [rel for rel in digests_sync if digests_sync[rel] != digests_async[rel]]
    assert different == [], different  # every file the same bytes: model, ZeRO partitions, data, RNG
    # the same step boundary on both ranks, after the slower rank (2 s) finished: training went on meanwhile
    assert r0["committed_at"] == r1["committed_at"] and r0["committed_at"] >= 2, (r0["committed_at"], r1["while"])
    assert all(r0["while"][:-1]) and all(r1["while"][:-1])
    assert r0["stall"] < 1.5  # the snapshot, not the 2 s write
    k = r0["committed_at"]
    assert r0["waited"] == r1["waited"] == [1, k + 1]  # at most one save in flight: the next commits it first
    assert [c.step for c in ck.list_committed(tmp_path / "async")] == [1, k + 1, k + 2]
    s = r0["summary"]
    assert s["checkpoint_async"] and s["checkpoints"] == 3 and len(s["checkpoint_saves"]) == 3
    first = s["checkpoint_saves"][0]
    assert 0 < first["snapshot_gb"] <= s["checkpoint_snapshot_gb_max"]
    assert first["write_s"] > 0 and first["stall_s"] >= first["snapshot_s"] + first["commit_s"] - 1e-9
    assert first["copy_s"] > 0  # the bytes were copied in the background (checkpoint.overlap_copy), then written
    logged = dict(r0["metrics"])[1]
    assert {"ckpt/stall_s", "ckpt/snapshot_gb", "ckpt/snapshot_s", "ckpt/commit_s", "ckpt/write_s"} <= set(logged)
