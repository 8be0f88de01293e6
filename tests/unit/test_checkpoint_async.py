"""Asynchronous checkpoint save (issue 20, criteria 3-5): the host snapshot is a real copy (training may go on
mutating the state in place), the background write produces the files a synchronous save writes, a background
failure is the same one-line error as a synchronous one on every rank, the commit is decided at a step boundary
identically on every rank, at most one snapshot exists, and ``checkpoint.async`` is the YAML key. The SIGKILL of
the whole job during a background write is in ``tests/test_train_e2e.py``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store as ck
from pretrain.checkpoint import weights
from pretrain.checkpoint.snapshot import BackgroundWrite, HostBuffers, HostCopy
from pretrain.checkpoint.writer import CheckpointWriter, Contents, FullWeights, LocalWorld, describe
from pretrain.config import ConfigError, from_dict, load_config, to_dict
from tests.distributed import run_distributed


def test_host_copy_is_a_copy_that_keeps_sharing_and_flags():
    base = torch.arange(12.0)
    param = torch.nn.Parameter(torch.ones(3))
    leaf = torch.zeros(2, requires_grad=True)
    state = {"a": base, "view": base[4:8], "tied": base, "p": param, "leaf": leaf, "n": 3, "t": (base, "x")}
    copier = HostCopy()
    snap = copier(state)
    base.add_(1)  # the optimizer's in-place update after the snapshot
    with torch.no_grad():
        param.mul_(5)
    assert torch.equal(snap["a"], torch.arange(12.0)) and torch.equal(snap["view"], torch.arange(4.0, 8.0))
    assert torch.equal(snap["p"], torch.ones(3)) and isinstance(snap["p"], torch.nn.Parameter)
    assert snap["leaf"].requires_grad and snap["n"] == 3 and snap["t"][1] == "x"
    # one copy per storage: views and tied tensors share it, as in the original (torch.save writes it once)
    assert snap["a"].untyped_storage().data_ptr() == snap["view"].untyped_storage().data_ptr() \
        == snap["tied"].untyped_storage().data_ptr() == snap["t"][0].untyped_storage().data_ptr()
    assert copier.nbytes == base.untyped_storage().nbytes() + param.untyped_storage().nbytes() \
        + leaf.untyped_storage().nbytes()


def _contents(tok: Path, step: int = 3) -> Contents:
    cfg = load_config(None, ["model.vocab_size=64", "model.hidden_size=16", "model.num_heads=2",
                             "model.num_layers=1", f"data.tokenizer={tok}"])
    weights_ = {"a.weight": torch.arange(12.0).reshape(3, 4), "b.bias": torch.ones(5)}
    state = {"step": step, "tokens_seen": 96, "sequences": 12, "last_train_loss": 2.5, "last_val": {}}
    return Contents(cfg=cfg, trainer_state=state, data_state={"streams": {"0": {"pos": 12}}},
                    model=FullWeights(weights_), rng_state={"torch": torch.arange(4, dtype=torch.uint8)})


def _tokenizer(tmp_path: Path) -> Path:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    return tok


def _digests(path: Path) -> dict[str, str]:
    return {rel: meta.sha256 for rel, meta in ck.read_manifest(path).files.items()}


def test_background_write_of_a_snapshot_is_the_synchronous_save(tmp_path):
    """The writer's snapshot, mutated after it was taken, written in a background thread and committed later:
    the same files, byte for byte, as a synchronous save of the state at the save step."""
    tok = _tokenizer(tmp_path)
    sync = CheckpointWriter(tmp_path / "sync", LocalWorld(), "r").save(_contents(tok))
    writer = CheckpointWriter(tmp_path / "async", LocalWorld(), "r")
    contents = _contents(tok)
    staged = writer.stage(3)
    snap = writer.snapshot(staged, contents)
    assert snap.nbytes >= 17 * 4  # the weights, copied
    contents.model.weights["a.weight"].add_(100)  # training goes on
    contents.data_state["streams"]["0"]["pos"] = 99
    write = BackgroundWrite(snap, 3, delay_s=0.2)
    assert not write.done() and not list(staged.path.rglob("*.safetensors"))  # nothing written yet
    assert not ck.list_committed(tmp_path / "async")  # in flight: invisible
    write.wait()
    assert write.error is None and write.snapshot is None  # the host copy is released
    final = writer.commit(staged, describe(contents, "r", 1), frozenset(), write.digests, write.error)
    assert _digests(final) == _digests(sync)
    assert torch.equal(weights.load_full_weights(final)["a.weight"], torch.arange(12.0).reshape(3, 4))


def test_host_buffers_are_reused_by_the_next_snapshot_and_its_files_are_the_same(tmp_path):
    """Two asynchronous saves sharing :class:`HostBuffers`: the second copies into the first's memory (no new
    allocation) and still writes the files a synchronous save of its own state writes; only one snapshot's
    storages are kept."""
    tok = _tokenizer(tmp_path)
    writer, buffers = CheckpointWriter(tmp_path / "async", LocalWorld(), "r"), HostBuffers()
    saved = []
    for step in (3, 4):
        contents = _contents(tok, step)
        contents.model.weights["a.weight"].add_(step)
        staged = writer.stage(step)
        snap = writer.snapshot(staged, contents, buffers=buffers)
        ptrs, nbytes = sorted(st.data_ptr() for st in snap.storages), snap.nbytes
        write = BackgroundWrite(snap, step)
        write.wait()
        assert write.error is None
        buffers.release(write.storages)
        saved.append((ptrs, writer.commit(staged, describe(contents, "r", 1), frozenset(), write.digests, None)))
        sync_contents = _contents(tok, step)
        sync_contents.model.weights["a.weight"].add_(step)
        sync = CheckpointWriter(tmp_path / f"sync{step}", LocalWorld(), "r").save(sync_contents)
        assert _digests(saved[-1][1]) == _digests(sync)
    assert saved[0][0] == saved[1][0]  # the same host memory both times
    assert buffers.nbytes == nbytes > 0  # one snapshot's worth kept


def test_background_failure_is_the_synchronous_failure(tmp_path, monkeypatch):
    """A write that fails: the synchronous save and the asynchronous commit raise the same one-line error, and
    nothing is committed."""
    tok = _tokenizer(tmp_path)

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(weights, "save_full_weights", disk_full)
    writer = CheckpointWriter(tmp_path / "run", LocalWorld(), "r")
    with pytest.raises(ck.CheckpointError) as sync_error:
        writer.save(_contents(tok))
    staged = writer.stage(3)
    write = BackgroundWrite(writer.snapshot(staged, _contents(tok)), 3)
    write.wait()
    with pytest.raises(ck.CheckpointError) as async_error:
        writer.commit(staged, describe(_contents(tok), "r", 1), frozenset(), write.digests, write.error)
    assert str(sync_error.value) == str(async_error.value) == \
        "checkpoint at step 3 failed: OSError: No space left on device"
    assert not ck.list_committed(tmp_path / "run")


def test_async_is_the_yaml_key_and_on_by_default():
    assert load_config(None, []).checkpoint.async_ is True
    cfg = load_config(None, ["checkpoint.async=false"])
    assert cfg.checkpoint.async_ is False and to_dict(cfg)["checkpoint"]["async"] is False
    assert from_dict(to_dict(cfg)).checkpoint.async_ is False  # the round trip a job and config.yaml take
    with pytest.raises(ConfigError, match=r"^checkpoint.async: expected bool, got int 2$"):
        load_config(None, ["checkpoint.async=2"])
    with pytest.raises(ConfigError, match=r"^checkpoint.async_: unknown key"):
        load_config(None, ["checkpoint.async_=true"])
    with pytest.raises(ConfigError,
                       match=r"^checkpoint.asink: unknown key \(valid: async, dir, direct_io, every_steps"):
        from_dict({"checkpoint": {"asink": True}})


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
    from tests.test_checkpoint_hashing import tiny_zero2_config

    torch.set_num_threads(1)
    work_dir = Path(work)
    cfg = tiny_zero2_config(work_dir, "faults.slow_checkpoint_at_step=1", f"faults.slow_checkpoint_s={0.5 + 1.5 * rank}")
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
    return {"waited": waited, "sync": str(sync_path), "async": str(path), "committed_at": committed_at, "stall": stall,
            "while": in_flight_while_training, "second": str(second), "summary": ckpt.summary(),
            "metrics": tracker.metrics}


@pytest.mark.slow
def test_async_engine_save_is_bitwise_the_sync_save_and_commits_at_one_step(tmp_path):
    results = run_distributed(_engine_saves, 2, str(tmp_path), timeout=900)
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
