"""The tokenize job's bookkeeping (``pretrain/driver/tokenize.py``) without Ray: bad records get their file's line
numbers across units, ``fail`` refuses the first in document order; a rerun matches its job whatever the mtimes."""

from __future__ import annotations

import json

import pytest

from pretrain.config import ConfigError, SourceConfig
from pretrain.data.bad_records import BadRecordError
from pretrain.data.shards.units import plan_units, tokenize_unit
from pretrain.data.sources import resolve_source
from pretrain.driver.tokenize import _bad_records, _same_job, parse
from tests.unit.data.common import make_docs


def _bytes(texts: list[str]) -> list[list[int]]:
    return [list(t.encode("utf-8")) for t in texts]


def test_bad_records_have_their_files_line_numbers_across_units(tmp_path):
    lines = [json.dumps({"text": d}) for d in make_docs(400, "x")]
    lines[4], lines[299] = "{broken", json.dumps({"other": 1})
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(lines) + "\n")
    sources = [resolve_source(SourceConfig(path=str(path)), ".")]
    units = plan_units(sources, 2000)
    assert len(units) > 5
    summaries = [tokenize_unit(u, sources[0], _bytes, tmp_path, 256) for u in units]
    bad = _bad_records(units, summaries, sources, "skip")
    assert bad["total"] == 2 and [e.split(": ")[0] for e in bad["examples"]] == [f"{path}:5", f"{path}:300"]
    with pytest.raises(BadRecordError, match=rf"^{path}:5: invalid JSON"):
        _bad_records(units, summaries, sources, "fail")
    assert sum(s["documents"] for s in summaries) == 398
    # the same file listed twice (oversampling): two sources, each counting lines from the file's start
    twice = [resolve_source(SourceConfig(path=str(path)), ".") for _ in range(2)]
    units = plan_units(twice, 2000)
    summaries = [tokenize_unit(u, twice[u.source], _bytes, tmp_path, 256) for u in units]
    bad = _bad_records(units, summaries, twice, "skip")
    assert bad["total"] == 4 and bad["by_source"] == {f"{path} (source 1)": 2, f"{path} (source 2)": 2}
    assert sorted({e.split(": ")[0] for e in bad["examples"]}) == [f"{path}:300", f"{path}:5"]


def test_a_vocabulary_too_small_for_a_byte_level_bpe_is_one_line():
    with pytest.raises(ConfigError) as e:
        parse(["c.jsonl", "--out", "x", "--vocab-size", "10"])
    assert str(e.value) == (
        "tokenize --vocab-size: at least 260 (a byte-level BPE's 256 bytes and its special tokens), got 10"
    )
    assert parse(["c.jsonl", "--out", "x", "--vocab-size", "10", "--tokenizer", "t"]).vocab_size == 10  # unused


def test_a_rerun_matches_a_job_whatever_the_modification_times():
    spec = {"sources": [{"fingerprint": {"files": {"a": {"size": 1, "mtime": 1.0, "sampled_sha256": "x"}}}}]}
    touched = json.loads(json.dumps(spec).replace("1.0", "2.0"))
    changed = json.loads(json.dumps(spec).replace('"x"', '"y"'))
    assert _same_job(spec, touched) and not _same_job(spec, changed)
