"""Data sources (``pretrain/data/sources.py``): the demo source's place, bad records (skipped with file and line, or
one line that fails), parquet sources and source resolution."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from pretrain.config import ConfigError, DataConfig, SourceConfig
from pretrain.data import BadRecordError, resolve_sources, training_documents
from tests.unit.data.common import T, batches, data_cfg, drain, make_docs, write_parquet, write_txt

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_demo_source_resolves_under_cache_dir(tmp_path, monkeypatch, tok):
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(cache_dir="rel_cache", num_streams=2)  # default sources: [demo]
    (src,) = resolve_sources(cfg.sources, cfg.cache_dir)
    assert Path(src.files[0]) == (tmp_path / "rel_cache" / "demo_corpus_v1.txt").resolve()
    b = batches(cfg, tok, G=4).next_step()
    assert b["input_ids"].shape == (4, T)


def bad_jsonl(path: Path) -> tuple[Path, dict[int, str]]:
    lines = [
        json.dumps({"text": "a good first document with several words"}).encode(),  # 1
        b'{"text": "unterminated',  # 2 invalid JSON
        json.dumps({"body": "no text field here"}).encode(),  # 3 missing field
        json.dumps({"text": 42}).encode(),  # 4 non-string
        b'{"text": "bad bytes \xff\xfe here"}',  # 5 bad UTF-8
        json.dumps({"text": ""}).encode(),  # 6 empty
        json.dumps({"text": "another good document, the last one"}).encode(),  # 7
        json.dumps({"text": " \t "}).encode(),  # 8 whitespace only
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, {2: "invalid_json", 3: "missing_field", 4: "not_string", 5: "bad_utf8", 6: "empty", 8: "empty"}


def test_bad_records_skip_reports_file_and_line(tmp_path, tok):
    path, bad = bad_jsonl(tmp_path / "bad.jsonl")
    cfg = data_cfg(path, num_streams=2, repeat=False)
    tb = batches(cfg, tok, G=2)
    drain(tb)
    summary = tb.bad_record_summary()
    assert summary["total"] == len(bad)
    assert summary["by_reason"] == dict(collections.Counter(bad.values()))
    assert len(summary["examples"]) == len(bad)
    for example, line in zip(summary["examples"], sorted(bad)):
        assert example.startswith(f"{path}:{line}: ") and "\n" not in example
    assert sorted(training_documents(cfg)) == [
        "a good first document with several words",
        "another good document, the last one",
    ]
    # two workers: each bad record is counted by exactly one of them
    totals = []
    for r in range(2):
        x = batches(cfg, tok, G=2, rank=r, world=2)
        drain(x)
        totals.append(x.bad_record_summary()["total"])
    assert sum(totals) == len(bad)


def test_bad_records_fail_raises_one_line(tmp_path, tok):
    path, _ = bad_jsonl(tmp_path / "bad.jsonl")
    cfg = data_cfg(path, num_streams=2, bad_records="fail")
    with pytest.raises(BadRecordError) as err:
        batches(cfg, tok, G=2).next_step()
    assert isinstance(err.value, ValueError)
    msg = str(err.value)
    assert msg.startswith(f"{path}:2: ") and "JSON" in msg and "\n" not in msg
    txt = tmp_path / "bytes.txt"
    txt.write_bytes(b"fine line one\n\nfine line two\nbroken \xc3\x28 line\n")
    with pytest.raises(BadRecordError, match=rf"^{txt}:4: undecodable"):
        list(training_documents(data_cfg(txt, bad_records="fail")))


def test_parquet_source_and_source_resolution(tmp_path, tok):
    d = tmp_path / "pq"
    d.mkdir()
    docs = make_docs(300, "pq", seed=4)
    write_parquet(d / "b.parquet", docs[150:])
    write_parquet(d / "a.parquet", docs[:100] + [None, "  "] + docs[100:150])
    (d / ".hidden.parquet").write_bytes(b"not parquet")
    cfg = data_cfg(d, num_streams=2, repeat=False)
    (src,) = resolve_sources(cfg.sources, cfg.cache_dir)
    assert src.format == "parquet" and [Path(f).name for f in src.files] == ["a.parquet", "b.parquet"]
    assert list(training_documents(cfg)) == docs
    tb = batches(cfg, tok, G=2)
    assert drain(tb) > 10
    summary = tb.bad_record_summary()
    assert summary["by_reason"] == {"empty": 1, "not_string": 1}
    assert summary["by_source"] == {str(d): 2}
    assert summary["examples"][0].startswith(f"{d / 'a.parquet'}:row 100: ")
    # glob and explicit format; a missing local file is a clear error
    glob_cfg = data_cfg(str(d / "*.parquet"), num_streams=2)
    assert list(training_documents(glob_cfg)) == docs
    with pytest.raises(ValueError, match="does not exist"):
        resolve_sources([SourceConfig(path=str(tmp_path / "nope.txt"))], tmp_path)
    with pytest.raises(ValueError, match="column"):
        list(training_documents(data_cfg(d, num_streams=2, sources=[SourceConfig(path=str(d), text_field="body")])))
    text_as_json = write_txt(tmp_path / "objs.data", [json.dumps({"text": x}) for x in docs[:5]])
    assert (
        list(
            training_documents(
                DataConfig(sources=[SourceConfig(path=str(text_as_json), format="json")], val_holdout=0.0)
            )
        )
        == docs[:5]
    )


def test_a_directory_of_compressed_data_files_is_refused_not_half_read(tmp_path):
    d = tmp_path / "gz"
    d.mkdir()
    write_txt(d / "part0.txt", ["one document"])
    for name in ("part1.jsonl.gz", "part2.jsonl.zst"):
        (d / name).write_bytes(b"\x1f\x8b\x08\x00")
    (d / "README.md").write_text("about the corpus")  # not data: not read, not refused
    with pytest.raises(ConfigError) as e:
        resolve_sources([SourceConfig(path=str(d))], ".", "data.sources")
    assert str(e.value).startswith(f"data.sources[0].path: {d / 'part1.jsonl.gz'} is compressed (.gz)")
    assert "decompress the 2 compressed file(s)" in str(e.value)
    for name in ("part1.jsonl.gz", "part2.jsonl.zst"):
        (d / name).unlink()
    assert [Path(f).name for f in resolve_sources([SourceConfig(path=str(d))], ".", "data.sources")[0].files] == [
        "part0.txt"
    ]
    # given by name or by a glob, a compressed file is refused as compressed, not as a format to set
    (d / "part1.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00")
    for given in (d / "part1.jsonl.gz", d / "*"):
        with pytest.raises(ConfigError, match=r"^data\.sources\[0\]\.path: .*part1\.jsonl\.gz is compressed \(\.gz\)"):
            resolve_sources([SourceConfig(path=str(given))], ".", "data.sources")
    # a directory of data files of other names: the refusal says how to read them
    other = tmp_path / "nd"
    other.mkdir()
    (other / "a.ndjson").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match=r"no data files .* in the directory .*; for files of other names, set"):
        resolve_sources([SourceConfig(path=str(other))], ".", "data.sources")
    json_dir = SourceConfig(path=str(other), format="json")
    assert resolve_sources([json_dir], ".", "data.sources")[0].files == [str(other / "a.ndjson")]


def test_a_manifest_json_of_another_kind_does_not_make_a_directory_token_shards(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    write_txt(d / "a.jsonl", [json.dumps({"text": "one document"})])
    (d / "manifest.json").write_text(json.dumps({"name": "my corpus", "text": "its description"}))
    (src,) = resolve_sources([SourceConfig(path=str(d))], ".", "data.sources")
    assert src.format == "json" and [Path(f).name for f in src.files] == ["a.jsonl", "manifest.json"]


def test_a_hub_path_pins_a_revision_that_load_dataset_gets(monkeypatch):
    import datasets

    for fmt in ("auto", "hub"):
        (src,) = resolve_sources([SourceConfig(path="org/corpus@v1.2", format=fmt)], ".", "data.sources")
        assert (src.format, src.hub_path, src.revision) == ("hub", "org/corpus", "v1.2")
    (plain,) = resolve_sources([SourceConfig(path="org/corpus")], ".")
    assert (plain.hub_path, plain.revision) == ("org/corpus", "")
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: calls.append((a, kw)))
    src.open_part(0)
    plain.open_part(0)
    assert calls == [
        (("org/corpus",), {"split": "train", "streaming": True, "revision": "v1.2"}),
        (("org/corpus",), {"split": "train", "streaming": True, "revision": None}),
    ]
