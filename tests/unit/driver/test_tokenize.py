"""The tokenize job (``pretrain/driver/tokenize.py``) without Ray: bad records get their file's line numbers across
units, ``fail`` refuses the first in document order; what ``--out`` may be (the job's spec alone:
``test_tokenize_job.py``). Whole jobs run their units in this process (:func:`_in_process`, in place of the Ray
Data job)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from pretrain.config import ConfigError, SourceConfig
from pretrain.data.bad_records import BadRecordError
from pretrain.data.shards.units import plan_units, tokenize_unit
from pretrain.data.sources import resolve_source
from pretrain.data.tokenizer import train_tokenizer
from pretrain.driver import tokenize as job
from pretrain.driver.tokenize import TokenizeUnits, _bad_records, parse, tokenize
from tests.unit.data.common import make_docs, write_parquet, write_txt


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


def test_config_trains_the_bpe_a_run_of_it_would_train(tmp_path):
    """``--config``: the tokenizer settings of a training config, so that the cache key (and the tokenizer) is what
    a run of it on the same sources has; without it the defaults. The job records them (another is another job)."""
    from pretrain.config import load_config
    from pretrain.data.tokenizer import TRAINER_SETTINGS
    from pretrain.data.tokenizer_cache import cache_key
    from pretrain.driver.tokenize import _data_config
    from pretrain.driver.tokenize_job import job_spec

    corpus = write_txt(tmp_path / "c.txt", make_docs(20, "cfg", seed=1))
    config = tmp_path / "run.yaml"
    config.write_text(
        "data:\n  tokenizer_vocab_size: 300\n  tokenizer_train_docs: 123\n  val_holdout: 0.05\n  bad_records: fail\n"
    )
    a = parse([str(corpus), "--out", str(tmp_path / "out"), "--config", str(config)])
    run = load_config(str(config), [f"data.sources=[{{path: {corpus}}}]"]).data
    assert a.vocab_size == 300 and a.bad_records == "fail"
    assert cache_key(_data_config(a), TRAINER_SETTINGS) == cache_key(run, TRAINER_SETTINGS)
    plain = parse([str(corpus), "--out", str(tmp_path / "out")])
    assert cache_key(_data_config(plain), TRAINER_SETTINGS) != cache_key(run, TRAINER_SETTINGS)
    spec = job_spec(a, _data_config(a), None, "tok")
    assert spec["tokenizer_data"] == {"train_docs": 123, "val_holdout": 0.05}
    assert "tokenizer_data" not in job_spec(plain, _data_config(plain), None, "tok")
    assert parse([str(corpus), "--out", "x", "--config", str(config), "--vocab-size", "512"]).vocab_size == 512


def _in_process(pending, sources, tok_dir, work, vocab, workers, total) -> None:
    """The pending units tokenized here, one after the other, by the actor the Ray Data job uses."""
    actor = TokenizeUnits([asdict(s) | {"_shards": None} for s in sources], str(tok_dir), str(work), vocab)
    for unit in pending:
        actor({"unit": np.array([json.dumps(asdict(unit))])})


@pytest.fixture
def tok_dir(tmp_path, monkeypatch) -> Path:
    """A saved tokenizer; the working directory is ``tmp_path`` and units run in this process."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "_run_units", _in_process)
    train_tokenizer(make_docs(200, "tok"), 300).save_pretrained(str(tmp_path / "tok"))
    return tmp_path / "tok"


def _files(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_a_directory_that_merely_has_a_work_folder_is_refused_and_left_as_it_was(tmp_path, tok_dir):
    corpus = write_txt(tmp_path / "c.txt", make_docs(50, "c"))
    out = tmp_path / "mine"
    for name in (".work/notes.txt", "tokenizer/vocab.txt", "shard-00000.npy"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("the user's")
    before = _files(out)
    with pytest.raises(ConfigError) as e:
        tokenize([str(corpus), "--out", str(out), "--tokenizer", str(tok_dir)])
    assert str(e.value) == (
        f"tokenize --out: {out} is not empty and holds neither token shards nor an unfinished tokenize job; give a "
        "new one (nothing was changed)"
    )
    assert _files(out) == before


def test_a_job_that_crashed_is_rerun_in_its_directory(tmp_path, tok_dir, monkeypatch, capsys):
    corpus = write_txt(tmp_path / "c.txt", make_docs(50, "c"))
    args = [str(corpus), "--out", "out", "--tokenizer", str(tok_dir)]

    def crash(*a) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "_run_units", crash)
    with pytest.raises(KeyboardInterrupt):
        tokenize(args)
    assert (tmp_path / "out" / ".work" / "job.json").is_file()  # written before any unit: the directory is the job's
    monkeypatch.setattr(job, "_run_units", _in_process)
    assert tokenize(args) == 0 and not (tmp_path / "out" / ".work").exists()
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["documents"] == 50
    assert tokenize(args) == 0 and "done already" in capsys.readouterr().out


def test_a_job_that_crashed_after_training_its_tokenizer_refuses_another_vocabulary(tmp_path, tok_dir, monkeypatch):
    """The tokenizer an unfinished job trained is reused by its rerun: a rerun asking for another ``--vocab-size`` is
    another job (refused in one line), never the old tokenizer under the new command; the trained one was kept whole
    (renamed into place)."""
    corpus = write_txt(tmp_path / "c.txt", make_docs(300, "c"))

    def crash(*a) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "_run_units", crash)
    monkeypatch.setenv("PRETRAIN_TOKENIZER_CACHE", "0")
    with pytest.raises(KeyboardInterrupt):
        tokenize([str(corpus), "--out", "out", "--vocab-size", "300"])
    work = tmp_path / "out" / ".work"
    assert sorted(p.name for p in work.iterdir()) == ["job.json", "tokenizer"]
    monkeypatch.setattr(job, "_run_units", _in_process)
    with pytest.raises(ConfigError) as e:
        tokenize([str(corpus), "--out", "out", "--vocab-size", "400"])
    assert str(e.value).startswith(f"tokenize --out: {tmp_path / 'out'} holds an unfinished job of other sources or")
    assert tokenize([str(corpus), "--out", "out", "--vocab-size", "300"]) == 0


def test_format_names_the_option_and_reads_every_source_so(tmp_path, tok_dir):
    notes = write_txt(tmp_path / "notes.md", make_docs(30, "n"))
    with pytest.raises(ConfigError) as e:
        tokenize([str(notes), "--out", "out", "--tokenizer", str(tok_dir)])
    assert str(e.value) == (
        f"tokenize SOURCE[0]: cannot tell the format of {notes} from its extension; give --format (text, json, parquet)"
    )
    assert not (tmp_path / "out").exists()
    assert tokenize([str(notes), "--out", "out", "--tokenizer", str(tok_dir), "--format", "text"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["documents"] == 30 and manifest["sources"][0]["format"] == "text"
    assert manifest["job"]["sources"][0]["format"] == "text"  # another --format is another job


def test_a_source_has_one_number_in_every_refusal(tmp_path, tok_dir):
    good, empty = write_txt(tmp_path / "a.txt", make_docs(30, "a")), tmp_path / "b.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"^tokenize SOURCE\[1\] \("):
        tokenize([str(good), str(empty), "--out", "out", "--tokenizer", str(tok_dir)])
    with pytest.raises(ConfigError, match=r"^tokenize SOURCE\[1\]\.path: .* does not exist"):
        tokenize([str(good), str(tmp_path / "gone.txt"), "--out", "out", "--tokenizer", str(tok_dir)])


def test_a_finished_output_made_skipping_bad_records_is_refused_under_fail(tmp_path, tok_dir, capsys):
    texts: list = make_docs(1600, "p")
    texts[1500] = None  # past the rows the corpus check reads: only the job meets it
    corpus = write_parquet(tmp_path / "c.parquet", texts)
    args = [str(corpus), "--out", "out", "--tokenizer", str(tok_dir)]
    assert tokenize(args) == 0
    with pytest.raises(BadRecordError) as e:
        tokenize([*args, "--bad-records", "fail"])
    assert str(e.value) == (
        f"{corpus}:row 1500: text field is not a string (NoneType) "
        f"(one of 1 bad record(s) that {tmp_path / 'out'} was made skipping)"
    )
    capsys.readouterr()
    assert tokenize(args) == 0 and "done already" in capsys.readouterr().out  # skip: as it was made
    # training on those shards under data.bad_records=fail is refused as training on the text would be
    from pretrain.config import DataConfig, SourceConfig
    from pretrain.data.sanity import check_sources

    shards = SourceConfig(path=str(tmp_path / "out"))
    check_sources(DataConfig(sources=[shards], bad_records="skip", tokenizer=str(tmp_path / "out" / "tokenizer")))
    with pytest.raises(BadRecordError) as e:
        check_sources(DataConfig(sources=[shards], bad_records="fail", tokenizer=str(tmp_path / "out" / "tokenizer")))
    assert str(e.value) == (
        f"{corpus}:row 1500: text field is not a string (NoneType) "
        f"(one of 1 bad record(s) that data.sources[0] ({tmp_path / 'out'}) was made skipping)"
    )
