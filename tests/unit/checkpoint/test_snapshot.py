"""Asynchronous checkpoint save in one process: the host snapshot is a real copy (training may go on mutating the
state in place), the background write produces the files a synchronous save writes, a background failure is a
one-line error, at most one snapshot exists, a deferred snapshot copies the bytes it met when told (the state it
reads must wait for it), and ``checkpoint.async`` is the YAML key. Two gloo ranks (the same bytes
as a synchronous save, the commit at one step boundary on every rank) are in
``tests/integration/checkpoint/test_async.py``; the SIGKILL of the whole job during a background write is in
``tests/integration/train/test_train_e2e.py``."""

from __future__ import annotations

import dataclasses
import errno
import os
from functools import partial
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import store as ck
from pretrain.checkpoint import weights
from pretrain.checkpoint.snapshot import BackgroundWrite, FileJob, HostBuffers, HostCopy, Snapshot
from pretrain.checkpoint.writer import CheckpointWriter, Contents, EngineState, FullWeights, LocalWorld, describe
from pretrain.config import ConfigError, from_dict, load_config, to_dict
from tests.harness import tiny_model


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
    assert (
        snap["a"].untyped_storage().data_ptr()
        == snap["view"].untyped_storage().data_ptr()
        == snap["tied"].untyped_storage().data_ptr()
        == snap["t"][0].untyped_storage().data_ptr()
    )
    assert (
        copier.nbytes
        == base.untyped_storage().nbytes() + param.untyped_storage().nbytes() + leaf.untyped_storage().nbytes()
    )


def _contents(tok: Path, step: int = 3) -> Contents:
    cfg = load_config(
        None,
        [
            *tiny_model(vocab_size=64, hidden_size=16, num_heads=2, num_layers=1, max_seq_len=None),
            f"data.tokenizer={tok}",
        ],
    )
    weights_ = {"a.weight": torch.arange(12.0).reshape(3, 4), "b.bias": torch.ones(5)}
    state = {"step": step, "tokens_seen": 96, "sequences": 12, "last_train_loss": 2.5, "last_val": {}}
    return Contents(
        cfg=cfg,
        trainer_state=state,
        data_state={"streams": {"0": {"pos": 12}}},
        model=FullWeights(weights_),
        rng_state={"torch": torch.arange(4, dtype=torch.uint8)},
    )


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
    assert (
        str(sync_error.value)
        == str(async_error.value)
        == "checkpoint at step 3 failed: OSError: No space left on device"
    )
    assert not ck.list_committed(tmp_path / "run")


def test_a_full_disk_in_the_engines_synchronous_save_is_the_asynchronous_failure(tmp_path):
    """The disk fills while the engine's own save writes its files (format ``deepspeed``, the one training writes):
    the synchronous save raises the one-line error the asynchronous commit raises when its background write fills
    the disk, nothing is committed, and the checkpoint committed before stays the latest and verifies."""
    tok = _tokenizer(tmp_path)
    writer = CheckpointWriter(tmp_path / "run", LocalWorld(), "r")
    before = writer.save(_contents(tok, step=2))

    def fill(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def engine_save(directory: Path, on_file) -> list[Path]:
        fill(directory / "mp_rank_00_model_states.pt")
        return []

    def engine_snapshot(directory: Path, host_copy) -> tuple[list[Path], list[FileJob]]:
        path = directory / "mp_rank_00_model_states.pt"
        return [], [FileJob([path], partial(fill, path))]

    contents = dataclasses.replace(_contents(tok), model=EngineState(engine_save, engine_snapshot))
    with pytest.raises(ck.CheckpointError) as sync_error:
        writer.save(contents)
    staged = writer.stage(3)
    write = BackgroundWrite(writer.snapshot(staged, contents), 3)
    write.wait()
    with pytest.raises(ck.CheckpointError) as async_error:
        writer.commit(staged, describe(contents, "r", 1), frozenset(), write.digests, write.error)
    assert (
        str(sync_error.value)
        == str(async_error.value)
        == "checkpoint at step 3 failed: OSError: [Errno 28] No space left on device"
    )
    latest = ck.latest_committed(tmp_path / "run")
    assert latest is not None and latest.path == before and latest.step == 2
    ck.verify(before)


def test_async_is_the_yaml_key_and_on_by_default():
    assert load_config(None, []).checkpoint.async_ is True
    cfg = load_config(None, ["checkpoint.async=false"])
    assert cfg.checkpoint.async_ is False and to_dict(cfg)["checkpoint"]["async"] is False
    assert from_dict(to_dict(cfg)).checkpoint.async_ is False  # the round trip a job and config.yaml take
    with pytest.raises(ConfigError, match=r"^checkpoint.async: expected bool, got int 2$"):
        load_config(None, ["checkpoint.async=2"])
    with pytest.raises(ConfigError, match=r"^checkpoint.async_: unknown key"):
        load_config(None, ["checkpoint.async_=true"])
    with pytest.raises(
        ConfigError, match=r"^checkpoint.asink: unknown key \(valid: async, dir, direct_io, every_steps"
    ):
        from_dict({"checkpoint": {"asink": True}})


def test_a_deferred_snapshot_copies_the_bytes_it_met_when_told_and_not_before(tmp_path):
    live = {"w": torch.arange(10, dtype=torch.float32), "tied": None}
    live["tied"] = live["w"][2:5]  # a view: shares the storage, as in a state dict
    copy = HostCopy(deferred=True)
    snap_state = copy(live)
    assert snap_state["tied"].untyped_storage().data_ptr() == snap_state["w"].untyped_storage().data_ptr()
    snap = Snapshot(tmp_path, deferred_copy=copy.copy_pending)
    assert not snap.copied.is_set()
    snap.finish_copy()
    assert snap.copied.is_set()
    live["w"].add_(100)  # the live state changes after the copy: the snapshot keeps the values it copied
    assert torch.equal(snap_state["w"], torch.arange(10, dtype=torch.float32))
    assert torch.equal(snap_state["tied"], torch.tensor([2.0, 3.0, 4.0]))
