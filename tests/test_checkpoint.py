"""The commit protocol on its own: staging, manifest, checksums, discovery, crash safety."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest
import torch

from pretrain.train import checkpoint as ck


def _stage(run_dir, step, world=2, nonce="n1"):
    stage = ck.staging_dir(run_dir, step, nonce)
    (stage / ck.DS_DIR / ck.DS_TAG).mkdir(parents=True)
    (stage / ck.DS_DIR / ck.DS_TAG / "model.pt").write_bytes(os.urandom(1000))
    for r in range(world):
        ck.save_rank_state(stage, r, {"streams": {str(r): {"pos": step}}}, {"torch": torch.get_rng_state()})
    return stage


def test_commit_list_resolve_verify(tmp_path):
    for step in (2, 4):
        ck.commit(_stage(tmp_path, step), tmp_path, step, {"tokens_seen": step * 10}, world_size=2)
    found = ck.list_committed(tmp_path)
    assert [c.step for c in found] == [2, 4]
    latest = ck.resolve(tmp_path)
    assert latest.step == 4 and latest.manifest["tokens_seen"] == 40
    assert set(latest.manifest["files"]) >= {"data/rank_0.json", "data/rank_1.json", "rng/rank_0.pt"}
    merged, rng = ck.load_rank_state(latest.path, 1)
    assert merged["streams"] == {"0": {"pos": 4}, "1": {"pos": 4}}
    assert torch.equal(rng["torch"], torch.get_rng_state())


def test_uncommitted_staging_is_invisible_and_cleaned(tmp_path):
    ck.commit(_stage(tmp_path, 2), tmp_path, 2, {}, world_size=2)
    _stage(tmp_path, 4, nonce="crashed")  # a save that died before commit
    assert ck.latest_committed(tmp_path).step == 2
    ck.cleanup_staging(tmp_path)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_incomplete_stage_is_refused(tmp_path):
    stage = _stage(tmp_path, 2, world=1)
    with pytest.raises(ck.CheckpointError, match="missing data/rank_1.json"):
        ck.commit(stage, tmp_path, 2, {}, world_size=2)
    assert ck.latest_committed(tmp_path) is None


def test_corruption_is_detected(tmp_path):
    path = ck.commit(_stage(tmp_path, 2), tmp_path, 2, {}, world_size=2)
    with open(path / ck.DS_DIR / ck.DS_TAG / "model.pt", "r+b") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
        ck.resolve(path)
    (path / ck.MANIFEST).write_text("{not json")
    assert ck.list_committed(tmp_path) == []


def _die_during_commit(run_dir):
    stage = _stage(run_dir, 6)
    real = ck.write_json

    def boom(path, obj):
        if path.name == ck.MANIFEST:
            os._exit(9)  # the process dies while committing
        real(path, obj)
    ck.write_json = boom
    ck.commit(stage, run_dir, 6, {}, world_size=2)


def test_crash_mid_commit_keeps_last_good(tmp_path):
    ck.commit(_stage(tmp_path, 4), tmp_path, 4, {"tokens_seen": 1}, world_size=2)
    p = mp.get_context("spawn").Process(target=_die_during_commit, args=(tmp_path,))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    latest = ck.resolve(tmp_path)
    assert latest.step == 4
    assert json.loads((latest.path / ck.MANIFEST).read_text())["tokens_seen"] == 1


def test_prune_keeps_newest(tmp_path):
    for step in (1, 2, 3):
        ck.commit(_stage(tmp_path, step), tmp_path, step, {}, world_size=2)
    ck.prune(tmp_path, keep_last=2)
    assert [c.step for c in ck.list_committed(tmp_path)] == [2, 3]


def test_damaged_checkpoint_names_the_newest_that_verifies(tmp_path):
    for step in (2, 4, 6):
        ck.commit(_stage(tmp_path, step), tmp_path, step, {}, world_size=2)
    for step in (4, 6):  # the two newest are damaged
        with open(tmp_path / ck.step_dir_name(step) / ck.DS_DIR / ck.DS_TAG / "model.pt", "r+b") as f:
            f.write(b"\0\0\0\0")
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve(tmp_path)
    good = tmp_path / ck.step_dir_name(2)
    assert str(e.value) == (f"{tmp_path / ck.step_dir_name(6)}: checksum mismatch for {ck.DS_DIR}/{ck.DS_TAG}/model.pt; "
                            f"the newest checkpoint that verifies is step 2: resume from it with "
                            f"./launch.sh resume {good}")
    assert ck.resolve(good).step == 2  # what that command resolves
    (good / ck.DS_DIR / ck.DS_TAG / "model.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="no older checkpoint of this run verifies"):
        ck.resolve(tmp_path)
