"""What a tokenize job is (``pretrain/driver/tokenize_job.py``): a rerun matches its job whatever the files'
modification times, and an edit in place is another job, also outside the sampled blocks. Whole jobs:
``test_tokenize.py``."""

from __future__ import annotations

import json

import pytest

from pretrain.driver.tokenize import parse
from pretrain.driver.tokenize_job import same_job


def test_a_rerun_matches_a_job_whatever_the_modification_times():
    spec = {"sources": [{"fingerprint": {"files": {"a": {"size": 1, "mtime": 1.0, "sampled_sha256": "x"}}}}]}
    touched = json.loads(json.dumps(spec).replace("1.0", "2.0"))
    changed = json.loads(json.dumps(spec).replace('"x"', '"y"'))
    assert same_job(spec, touched) and not same_job(spec, changed)  # a job recorded with sampled hashes only
    whole = json.loads(json.dumps(spec).replace('"x"', '"x", "sha256": "h"'))
    edited = json.loads(json.dumps(whole).replace('"h"', '"e"'))  # same size, same sampled blocks, another byte
    assert same_job(whole, json.loads(json.dumps(whole).replace("1.0", "2.0"))) and not same_job(whole, edited)


def test_an_edit_in_place_outside_the_sampled_blocks_is_another_job(tmp_path, monkeypatch):
    """A record fixed in place (same size, outside the blocks a fingerprint samples) makes the spec another job:
    a rerun does not answer "done already" with the shards of the file before the fix. A file whose size,
    modification time and sampled hash are as the job recorded is not read again."""
    from pretrain.data import file_hash
    from pretrain.data.file_hash import BLOCK, BLOCKS, file_fingerprint
    from pretrain.driver.tokenize import _data_config
    from pretrain.driver.tokenize_job import job_spec

    path = tmp_path / "c.jsonl"
    line = '{"text": "some words of a document"}\n'
    path.write_text(line * (3 * BLOCK * BLOCKS // len(line)))
    a = parse([str(path), "--out", str(tmp_path / "out"), "--tokenizer", "t"])
    before = job_spec(a, _data_config(a), None, "tok")
    with monkeypatch.context() as m:
        m.setattr(file_hash, "full_sha256", lambda name: pytest.fail(f"{name} read again"))
        assert job_spec(a, _data_config(a), None, "tok", before) == before
    text = path.read_text()
    at = len(text) // 2 + BLOCK // 3  # between two sampled blocks
    at = text.index("\n", at) + 1
    path.write_text(text[:at] + text[at:].replace('"text"', '"txet"', 1))
    assert (
        file_fingerprint(str(path))["sampled_sha256"]
        == list(before["sources"][0]["fingerprint"]["files"].values())[0]["sampled_sha256"]
    )
    assert not same_job(before, job_spec(a, _data_config(a), None, "tok"))
    assert not same_job(before, job_spec(a, _data_config(a), None, "tok", before))  # its mtime changed: read again
