"""Data fingerprints: a resume notices a source that was appended to, truncated or edited in place, and not a
file that was only touched or copied; the refusal is one line naming the file and how it changed."""

from __future__ import annotations

import os

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.data.fingerprint import BLOCK, BLOCKS, check_unchanged, differences, fingerprints


def _data(tmp_path, *extra):
    return load_config(None, [f"data.sources=[{{path: {tmp_path / 'a.txt'}}}]", *extra]).data


def test_changes_are_named_and_a_touch_is_not_one(tmp_path):
    big = BLOCK * BLOCKS * 3  # sampled, not hashed whole
    corpus = tmp_path / "a.txt"
    corpus.write_bytes(b"x" * big)
    data = _data(tmp_path)
    before = fingerprints(data)
    os.utime(corpus, (1, 1))  # a touch or a copy: same bytes
    assert differences(before, fingerprints(data)) == []
    with open(corpus, "ab") as f:
        f.write(b"more\n")
    (change,) = differences(before, fingerprints(data))
    assert change.startswith(f"data.sources[0]: {corpus} size {big:,} -> {big + 5:,} bytes (modified ")
    corpus.write_bytes(b"y" + b"x" * (big - 1))  # same size, first block edited
    assert "content changed, same size" in differences(before, fingerprints(data))[0]


def test_a_resume_on_changed_data_is_refused_unless_allowed(tmp_path):
    (tmp_path / "a.txt").write_text("one line\n" * 100)
    data = _data(tmp_path)
    recorded = fingerprints(data)
    (tmp_path / "a.txt").write_text("one line\n" * 50)
    with pytest.raises(ConfigError) as e:
        check_unchanged(recorded, data, "/ckpt/step_00000004")
    line = str(e.value)
    assert "\n" not in line and line.startswith("data changed since checkpoint /ckpt/step_00000004: data.sources[0]")
    assert "900 -> 450 bytes" in line and "data.allow_changed=true" in line
    assert check_unchanged(recorded, _data(tmp_path, "data.allow_changed=true"), "x") != recorded
    assert check_unchanged(None, data, "x") == fingerprints(data)  # a checkpoint without one: not compared


def test_a_hub_dataset_is_recorded_with_its_pinned_revision():
    pinned = load_config(None, ["data.sources=[{path: org/corpus@abc123}, {path: org/corpus}]"]).data
    recorded = fingerprints(pinned)
    assert recorded["data.sources[0]"] == {
        "path": "org/corpus@abc123",
        "hub": "org/corpus",
        "split": "train",
        "revision": "abc123",
    }
    assert recorded["data.sources[1]"]["revision"] == "unpinned"
