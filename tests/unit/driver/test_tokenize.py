"""The tokenize job's bookkeeping (``pretrain/driver/tokenize.py``) without Ray: bad records get their file's line
numbers across units, ``fail`` refuses the first in document order; a rerun matches its job whatever the mtimes."""

from __future__ import annotations

import json

import pytest

from pretrain.config import SourceConfig
from pretrain.data.bad_records import BadRecordError
from pretrain.data.shards.units import plan_units, tokenize_unit
from pretrain.data.sources import resolve_source
from pretrain.driver.tokenize import _bad_records, _same_job
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


def test_a_rerun_matches_a_job_whatever_the_modification_times():
    spec = {"sources": [{"fingerprint": {"files": {"a": {"size": 1, "mtime": 1.0, "sampled_sha256": "x"}}}}]}
    touched = json.loads(json.dumps(spec).replace("1.0", "2.0"))
    changed = json.loads(json.dumps(spec).replace('"x"', '"y"'))
    assert _same_job(spec, touched) and not _same_job(spec, changed)
