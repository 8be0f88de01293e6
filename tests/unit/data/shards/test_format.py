"""The token-shard format (``pretrain/data/shards/format.py``): dtypes, file sizes, the manifest's checks."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

from pretrain.data.shards.format import (
    MANIFEST,
    ShardError,
    check_files,
    dtype_for,
    is_shard_dir,
    load_manifest,
    npy_bytes,
    shard_name,
    tokenizer_hash,
)


def test_dtype_is_uint16_while_the_vocabulary_fits():
    assert dtype_for(300) == "uint16"
    assert dtype_for(1 << 16) == "uint16"
    assert dtype_for((1 << 16) + 1) == "uint32"
    with pytest.raises(ValueError, match="does not fit uint32"):
        dtype_for((1 << 32) + 1)


@pytest.mark.parametrize("dtype,np_dtype", [("uint16", "<u2"), ("uint32", "<u4")])
def test_npy_bytes_is_what_np_save_writes(dtype, np_dtype):
    for n in (0, 1, 999, 70_000):
        f = io.BytesIO()
        np.save(f, np.zeros(n, np_dtype))
        assert npy_bytes(dtype, n) == len(f.getvalue())


def test_tokenizer_hash_is_the_same_for_a_copy_and_differs_for_another(tok_dir, tmp_path):
    copy = shutil.copytree(tok_dir, tmp_path / "copy")
    assert tokenizer_hash(copy) == tokenizer_hash(tok_dir)
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["added_tokens"][0]["content"] = "<|other|>"
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    assert tokenizer_hash(copy) != tokenizer_hash(tok_dir)


def _copy(shards, tmp_path):
    return shutil.copytree(shards, tmp_path / "s", ignore=shutil.ignore_patterns(".work"))


def test_a_newer_format_and_an_overflowing_vocabulary_are_refused_in_one_line(shards, tmp_path):
    d = _copy(shards, tmp_path)
    raw = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps({**raw, "version": 99}))
    with pytest.raises(ShardError, match=r"format version 99 is newer than this code reads \(up to 1\)") as e:
        load_manifest(d)
    assert "\n" not in str(e.value)
    (d / MANIFEST).write_text(json.dumps({**raw, "tokenizer": {**raw["tokenizer"], "vocab_size": 70_000}}))
    with pytest.raises(ShardError, match="70,000 tokens overflows the shards' dtype uint16"):
        load_manifest(d)
    (d / MANIFEST).write_text("{not json")
    with pytest.raises(ShardError, match="not valid JSON"):
        load_manifest(d)


def test_a_truncated_or_corrupted_shard_is_named_with_expected_and_found(shards, tmp_path):
    d = _copy(shards, tmp_path)
    m = load_manifest(d)
    check_files(d, m, full=True)
    shard = d / shard_name(1)
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(
        ShardError, match=rf"{shard_name(1)}: truncated: {len(data) - 10:,} bytes, the manifest says {len(data):,}"
    ):
        check_files(d, m)
    shard.write_bytes(data[:-2] + bytes([data[-2] ^ 1, data[-1]]))
    with pytest.raises(ShardError, match=rf"{shard_name(1)}: corrupted: sampled sha256 \w+\.\.\., the manifest says"):
        check_files(d, m)
    with pytest.raises(ShardError, match=rf"{shard_name(1)}: corrupted: sha256"):
        check_files(d, m, full=True)
    shard.unlink()
    with pytest.raises(ShardError, match=rf"{shard_name(1)}: missing"):
        check_files(d, m)


def test_only_a_token_shard_manifest_makes_a_shard_directory(tmp_path, shards):
    assert is_shard_dir(shards) and not is_shard_dir(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "my corpus"}))
    assert not is_shard_dir(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    assert not is_shard_dir(tmp_path)
