"""Checksums without reading: the early presence check hashes no file, accepts manifests without sizes, and finds a
size mismatch. Hashing on real ranks and the ``verify`` command are in
``tests/integration/checkpoint/test_hashing.py``."""

from __future__ import annotations

import json
import shutil

import pytest

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store
from tests.conftest import FIXTURES

OLD = FIXTURES / "old_checkpoint" / "step_00000002"


def test_presence_check_reads_no_file_and_old_manifests_without_sizes(tmp_path, monkeypatch):
    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)
    raw = json.loads((ckpt / ly.MANIFEST).read_text())
    for entry in raw["files"].values():
        del entry["bytes"]  # a manifest that recorded no sizes
    (ckpt / ly.MANIFEST).write_text(json.dumps(raw))
    store.verify(ckpt)  # still verifies (checksums)
    monkeypatch.setattr(store, "sha256_file", lambda p: pytest.fail(f"read {p}"))
    found = store.resolve(ckpt, full=False)  # the driver's early check: no file is hashed
    rel = "rng/rank_0.pt"
    (ckpt / rel).unlink()
    with pytest.raises(store.CheckpointError, match=f"missing file {rel}; no older checkpoint of this run verifies"):
        store.verify_or_point_back(found, full=False)


def test_size_mismatch_is_found_without_reading(tmp_path, monkeypatch):
    ckpt = shutil.copytree(OLD, tmp_path / "run" / OLD.name)
    monkeypatch.setattr(store, "sha256_file", lambda p: pytest.fail(f"read {p}"))
    rel = "trainer_state.json"
    with open(ckpt / rel, "a") as f:
        f.write(" ")
    with pytest.raises(store.CheckpointError, match=f"^{ckpt}: checksum mismatch for {rel}; no older"):
        store.resolve(ckpt, full=False)
