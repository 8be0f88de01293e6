"""Committed checkpoints on disk (``pretrain/checkpoint/store.py``): the commit protocol (staging, manifest,
checksums, discovery), damaged checkpoints, pruning (out of sight at once, deleted off the loop), and checksums
without reading (the early presence check hashes no file, accepts manifests without sizes, finds a size mismatch).
A process killed mid-commit and the resume of full weights on a gloo rank are in
``tests/integration/checkpoint/test_checkpoint.py``; hashing on real ranks and the ``verify`` command in
``tests/integration/checkpoint/test_hashing.py``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import reader
from pretrain.checkpoint import store as ck
from pretrain.checkpoint.manifest import Manifest
from tests.conftest import FIXTURES


def _stage(run_dir, step, world=2, nonce="n1"):
    stage = ly.staging_dir(run_dir, step, nonce)
    (stage / ly.DS_DIR / ly.DS_TAG).mkdir(parents=True)
    (stage / ly.DS_DIR / ly.DS_TAG / "model.pt").write_bytes(os.urandom(1000))
    for r in range(world):
        ck.write_json(stage / ly.data_file(r), {"streams": {str(r): {"pos": step}}})
        (stage / ly.rng_file(r)).parent.mkdir(exist_ok=True)
        torch.save({"torch": torch.get_rng_state()}, stage / ly.rng_file(r))
    return stage


def _commit(run_dir, step, world=2, **fields):
    return ck.commit(_stage(run_dir, step, world), run_dir, Manifest(step=step, world_size=2, **fields))


def test_commit_list_resolve_verify(tmp_path):
    for step in (2, 4):
        _commit(tmp_path, step, tokens_seen=step * 10)
    found = ck.list_committed(tmp_path)
    assert [c.step for c in found] == [2, 4]
    latest = ck.resolve(tmp_path)
    assert latest.step == 4 and latest.manifest.tokens_seen == 40
    assert set(latest.manifest.files) >= {"data/rank_0.json", "data/rank_1.json", "rng/rank_0.pt"}
    merged, rng = reader.load_rank_state(latest.path, 1)
    assert merged["streams"] == {"0": {"pos": 4}, "1": {"pos": 4}}
    assert torch.equal(rng["torch"], torch.get_rng_state())


def test_uncommitted_staging_is_invisible_and_cleaned(tmp_path):
    _commit(tmp_path, 2)
    _stage(tmp_path, 4, nonce="crashed")  # a save that died before commit
    (tmp_path / ".tmp-tokenizer-crashed").mkdir()  # a resume by run id that died copying the run's tokenizer
    assert ck.latest_committed(tmp_path).step == 2
    ck.cleanup_staging(tmp_path)
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_a_directory_fsync_raises_io_errors_and_passes_over_filesystems_that_cannot(tmp_path, monkeypatch):
    """A commit's rename is durable only once its directory is fsynced: EIO there is an error (a commit reported
    durable that is not), EINVAL (a filesystem that cannot fsync a directory) is not."""
    import errno

    for code, raises in ((errno.EINVAL, False), (errno.ENOTSUP, False), (errno.EIO, True), (errno.ENOSPC, True)):

        def fsync(fd, code=code):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "fsync", fsync)
        if raises:
            with pytest.raises(OSError, match=os.strerror(code)):
                ck.fsync_dir(tmp_path)
        else:
            ck.fsync_dir(tmp_path)


def test_incomplete_stage_is_refused(tmp_path):
    stage = _stage(tmp_path, 2, world=1)
    with pytest.raises(ck.CheckpointError, match="missing data/rank_1.json"):
        ck.commit(stage, tmp_path, Manifest(step=2, world_size=2))
    assert ck.latest_committed(tmp_path) is None


def test_corruption_is_detected(tmp_path):
    path = _commit(tmp_path, 2)
    with open(path / ly.DS_DIR / ly.DS_TAG / "model.pt", "r+b") as f:
        f.write(b"\0\0\0\0")
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
        ck.resolve(path)
    (path / ly.MANIFEST).write_text("{not json")
    assert ck.list_committed(tmp_path) == []


def test_prune_keeps_newest(tmp_path):
    for step in (1, 2, 3):
        _commit(tmp_path, step)
    ck.prune(tmp_path, keep_last=2)
    assert [c.step for c in ck.list_committed(tmp_path)] == [2, 3]


def test_damaged_checkpoint_names_the_newest_that_verifies(tmp_path):
    for step in (2, 4, 6):
        _commit(tmp_path, step)
    for step in (4, 6):  # the two newest are damaged
        with open(tmp_path / ly.step_dir_name(step) / ly.DS_DIR / ly.DS_TAG / "model.pt", "r+b") as f:
            f.write(b"\0\0\0\0")
    with pytest.raises(ck.CheckpointError) as e:
        ck.resolve(tmp_path)
    good = tmp_path / ly.step_dir_name(2)
    assert str(e.value) == (
        f"{tmp_path / ly.step_dir_name(6)}: checksum mismatch for {ly.DS_DIR}/{ly.DS_TAG}/model.pt; "
        f"the newest checkpoint that verifies is step 2: resume from it with "
        f"./launch.sh resume {good}"
    )
    assert ck.resolve(good).step == 2  # what that command resolves
    (good / ly.DS_DIR / ly.DS_TAG / "model.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="no older checkpoint of this run verifies"):
        ck.resolve(tmp_path)


def test_a_newest_checkpoint_whose_manifest_is_unreadable_is_refused_not_skipped(tmp_path):
    """A commit renames a complete manifest into place, so an unreadable one is damage: the run's latest checkpoint is
    not silently the one before (verify, resume, eval and export all start from ``latest_committed``)."""
    for step in (2, 4, 6):
        _commit(tmp_path, step)
    assert ck.latest_committed(tmp_path).step == 6
    (tmp_path / ly.step_dir_name(6) / ly.MANIFEST).write_text("{bad")
    assert [c.step for c in ck.list_committed(tmp_path)] == [2, 4]  # listings still show the good ones
    with pytest.raises(ck.CheckpointError) as e:
        ck.latest_committed(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / ly.step_dir_name(6)}/{ly.MANIFEST}: corrupt manifest")
    assert str(e.value).endswith(
        f"the newest checkpoint that verifies is step 4: resume from it with "
        f"./launch.sh resume {tmp_path / ly.step_dir_name(4)}"
    )
    # bytes that are no UTF-8, and no manifest at all: damage too, refused the same way
    (tmp_path / ly.step_dir_name(6) / ly.MANIFEST).write_bytes(b"\xff\xfe{")
    with pytest.raises(ck.CheckpointError, match=r"corrupt manifest .*the newest checkpoint that verifies is step 4"):
        ck.latest_committed(tmp_path)
    (tmp_path / ly.step_dir_name(6) / ly.MANIFEST).unlink()
    with pytest.raises(ck.CheckpointError) as e:
        ck.latest_committed(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / ly.step_dir_name(6)}: not a committed checkpoint (no {ly.MANIFEST})")
    assert "the newest checkpoint that verifies is step 4" in str(e.value)


OLD = FIXTURES / "old_checkpoint" / "step_00000002"


def test_the_early_check_hashes_only_what_the_driver_parses_and_old_manifests_without_sizes(tmp_path, monkeypatch):
    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)
    raw = json.loads((ckpt / ly.MANIFEST).read_text())
    for entry in raw["files"].values():
        del entry["bytes"]  # a manifest that recorded no sizes
    (ckpt / ly.MANIFEST).write_text(json.dumps(raw))
    ck.verify(ckpt)  # still verifies (checksums)
    hashed, sha256_file = [], ck.sha256_file

    def parsed_only(path):
        hashed.append(path.relative_to(ckpt).as_posix())
        assert hashed[-1] in ck.PARSED_EARLY, f"read {path}"
        return sha256_file(path)

    monkeypatch.setattr(ck, "sha256_file", parsed_only)
    found = ck.resolve(ckpt, full=False)  # the driver's early check: only config.yaml and trainer_state.json
    assert sorted(hashed) == sorted(ck.PARSED_EARLY)
    rel = "rng/rank_0.pt"
    (ckpt / rel).unlink()
    with pytest.raises(ck.CheckpointError, match=f"missing file {rel}; no older checkpoint of this run verifies"):
        ck.verify_or_point_back(found, full=False)


def test_size_mismatch_is_found_without_reading(tmp_path, monkeypatch):
    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)
    monkeypatch.setattr(ck, "sha256_file", lambda p: pytest.fail(f"read {p}"))
    rel = "trainer_state.json"
    with open(ckpt / rel, "a") as f:
        f.write(" ")
    with pytest.raises(ck.CheckpointError, match=f"^{ckpt}: checksum mismatch for {rel}; no older"):
        ck.resolve(ckpt, full=False)


def test_a_same_size_corruption_of_a_file_the_driver_parses_is_found_early_and_points_back(tmp_path):
    """The driver parses config.yaml and trainer_state.json before any worker starts: a byte changed in either is
    the early check's one-line error naming the newest older checkpoint that verifies, not a parse error."""
    for step in (2, 4):
        stage = _stage(tmp_path, step)
        (stage / ly.CONFIG).write_text("name: parsed\n")
        ck.write_json(stage / ly.TRAINER_STATE, {"step": step})
        ck.commit(stage, tmp_path, Manifest(step=step, world_size=2))
    for rel in sorted(ck.PARSED_EARLY):
        damaged = tmp_path / ly.step_dir_name(4) / rel
        good = damaged.read_bytes()
        damaged.write_bytes(good[:-1] + (b"x" if good[-1:] != b"x" else b"y"))
        with pytest.raises(ck.CheckpointError, match=f"checksum mismatch for {rel}; .* verifies is step 2"):
            ck.verify_or_point_back(ck.latest_committed(tmp_path, full=False), full=False)
        damaged.write_bytes(good)


def test_a_file_that_cannot_be_read_is_the_checkpoints_one_line_error(tmp_path, monkeypatch):
    """A read error while hashing (EIO, a stale NFS handle) is a CheckpointError naming the file, as a corrupt one
    is (the resume's verification gathers it from every rank; a raw OSError on one rank left the others waiting)."""
    import errno

    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)

    def unreadable(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ck, "sha256_file", unreadable)
    with pytest.raises(ck.CheckpointError, match=rf"^{ckpt}: cannot read \S+ \(Input/output error\)$"):
        ck.verify(ckpt)
    with pytest.raises(ck.CheckpointError, match="cannot read .*; no older checkpoint of this run verifies"):
        ck.verify_or_point_back(ck.resolve(ckpt, full=False))


def test_a_recommit_interrupted_between_its_renames_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """A re-run of a committed step sets the old checkpoint aside, then renames the new one into place: killed
    between the two, the step has no directory; the next start puts the old one back (and removes the new one's
    staging), while a set-aside whose step is there again, or a pruned checkpoint, is removed."""
    _commit(tmp_path, 3)
    _commit(tmp_path, 5, tokens_seen=50)
    rename = os.replace

    def killed_before_the_new_one_lands(src, dst):
        if os.path.basename(src).startswith(ly.STAGING_PREFIX) and ly.step_of(os.path.basename(dst)) == 5:
            raise KeyboardInterrupt("killed between the two renames")
        rename(src, dst)

    monkeypatch.setattr(ck.os, "replace", killed_before_the_new_one_lands)
    with pytest.raises(KeyboardInterrupt):
        _commit(tmp_path, 5, tokens_seen=99)
    monkeypatch.setattr(ck.os, "replace", rename)
    assert ck.latest_committed(tmp_path).step == 3
    _commit(tmp_path, 7)
    assert ck.prune(tmp_path, keep_last=1, delete=False)[0].name.startswith(ly.REPLACED_PREFIX)  # pruned: step 3
    ck.cleanup_staging(tmp_path)  # the next start
    assert [(c.step, c.manifest.tokens_seen) for c in ck.list_committed(tmp_path)] == [(5, 50), (7, 0)]
    ck.verify(tmp_path / ly.step_dir_name(5))
    assert sorted(p.name for p in tmp_path.iterdir()) == [ly.step_dir_name(5), ly.step_dir_name(7)]
    ly.superseded_dir(tmp_path, 7, "x").mkdir()  # set aside by a re-commit that completed, then killed
    assert ck.restore_superseded(tmp_path) == []
    ck.cleanup_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ly.step_dir_name(5), ly.step_dir_name(7)]


def test_pruned_checkpoints_leave_sight_at_once_and_are_deleted_later(tmp_path):
    for step in (1, 2, 3):
        _commit(tmp_path, step)
    trash = ck.prune(tmp_path, keep_last=1, delete=False)
    assert [c.step for c in ck.list_committed(tmp_path)] == [3]  # resume and rollback no longer see them
    assert len(trash) == 2 and all(p.is_dir() and p.name.startswith(ly.LEFTOVER_PREFIXES) for p in trash)
    ck.cleanup_staging(tmp_path)  # a run killed before deleting them: the next start does
    assert not any(p.exists() for p in trash)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ly.step_dir_name(3)]
