"""Bad input, from config to corpus to checkpoint: the driver's corpus sanity (pretrain/data/sanity.py), the
driver's file-system checks (pretrain/driver/prepare.py), and the sequence-level fallback for a corpus of too few
documents. The command line's one-line refusals are in ``tests/integration/cli/test_bad_input.py``."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, DataConfig, SourceConfig, layout, load_config
from pretrain.data import BadRecordError, TrainBatches, load_or_train_tokenizer, validation_sequences
from pretrain.data.sanity import check_corpus, check_source, check_sources, why_not_text
from pretrain.data.sources import cut_pieces, read_lines
from pretrain.data.split_plan import plan_split

WORDS = "the a of to and in is that it for on with as was by be at this from or an are river mountain".split()


pytestmark = pytest.mark.usefixtures("datasets_cache")


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def cfg_for(*paths, **kw) -> DataConfig:
    return DataConfig(sources=[SourceConfig(path=str(p)) for p in paths], **kw)


def refusal(cfg: DataConfig) -> str:
    with pytest.raises(ConfigError) as e:
        check_sources(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_empty_no_text_field_and_blank_sources_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert refusal(cfg_for(empty)) == f"data.sources[0] ({empty}): empty: 1 file(s) of 0 bytes"
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text("".join(json.dumps({"body": f"doc {i}", "id": i}) + "\n" for i in range(30)))
    msg = refusal(cfg_for(nofield))
    assert msg.startswith(f"data.sources[0] ({nofield}): no usable record in the first 30 (30 missing text field")
    assert f"{nofield}:1:" in msg and "the records have the fields body, id: set text_field" in msg
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\n")
    assert "empty: only blank lines" in refusal(cfg_for(blank))
    invalid = tmp_path / "invalid.jsonl"
    invalid.write_text('not json\n{"text": \n')
    assert "no usable record in the first 2 (2 invalid JSON" in refusal(cfg_for(invalid))
    # a validation source is checked the same way, under its own key
    good = tmp_path / "good.txt"
    good.write_text(words(50) + "\n")
    assert refusal(cfg_for(good, val_sources=[SourceConfig(path=str(empty))])).startswith("data.val_sources[0] (")


def test_binary_and_compressed_sources_are_not_text(tmp_path):
    rnd = tmp_path / "random.txt"
    rnd.write_bytes(random.Random(0).randbytes(100_000))
    msg = refusal(cfg_for(rnd))
    assert msg.startswith(f"data.sources[0] ({rnd}): not text: {rnd}: ") and "not UTF-8 text" in msg
    gz = tmp_path / "corpus.jsonl"
    gz.write_bytes(gzip.compress(b'{"text": "hello"}\n' * 100))
    assert "gzip-compressed" in refusal(cfg_for(gz))
    utf16 = tmp_path / "utf16.txt"
    utf16.write_bytes(("hello world, a line of text\n" * 100).encode("utf-16"))
    assert "UTF-16" in refusal(cfg_for(utf16))
    # a parquet file named as text: the fix names the key to set, or the command's option
    pq = tmp_path / "rows.txt"
    pq.write_bytes(b"PAR1" + bytes(200))
    assert refusal(cfg_for(pq)).endswith("it looks like a parquet file (set data.sources[0].format: parquet)")
    with pytest.raises(ConfigError) as e:
        check_source(SourceConfig(path=str(pq)), "tokenize SOURCE[0]", cfg_for(pq), format_option="--format")
    assert str(e.value).endswith("it looks like a parquet file (give --format parquet)")
    assert why_not_text("naïve café 東京 ☕\n".encode() * 100) == ""
    assert why_not_text(b"mostly text \xe9 with a latin-1 byte\n" * 100) == ""


def test_sources_that_match_nothing_name_the_key(tmp_path):
    nothing = f"{tmp_path}/nope/*.jsonl"
    assert refusal(cfg_for(nothing)) == f"data.sources[0].path: no file matches {nothing}"
    assert refusal(cfg_for(tmp_path / "nope.jsonl")) == f"data.sources[0].path: {tmp_path}/nope.jsonl does not exist"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.md").write_text("x")
    assert "no data files" in refusal(cfg_for(tmp_path / "d"))
    odd = tmp_path / "corpus.bin"
    odd.write_text("text\n")
    assert refusal(cfg_for(odd)).startswith("data.sources[0].format: cannot tell the format")
    # every source is resolved before any is read: the second source's typo is found at once
    good = tmp_path / "good.txt"
    good.write_text(words(50) + "\n")
    assert refusal(cfg_for(good, tmp_path / "typo.txt")).startswith("data.sources[1].path: ")


def test_bad_records_in_the_prefix(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "unterminated\n' + json.dumps({"text": "x"}) + "\n")
    check_sources(cfg_for(path))  # skip: a usable record is enough
    with pytest.raises(BadRecordError, match=rf"^{path}:2: invalid JSON"):
        check_sources(cfg_for(path, bad_records="fail"))
    late = tmp_path / "late.jsonl"  # beyond the prefix: under fail the driver reads on
    late.write_text("\n".join([json.dumps({"text": "fine"})] * 1501 + ['{"text": 1}']) + "\n")
    check_sources(cfg_for(late))
    with pytest.raises(BadRecordError, match=rf"^{late}:1502: text field is not a string"):
        check_sources(cfg_for(late, bad_records="fail"))
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "ok"}\n{"text": "lone \\ud800 surrogate"}\n')
    records = list(read_lines([str(surrogate)], "json", "text"))
    assert records[1]["bad"] == "bad_unicode" and "U+D800" in records[1]["msg"]


def test_parquet_and_hub_sources_are_checked_on_their_first_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": [words(20, i) for i in range(10)]}), good)
    check_sources(cfg_for(good))
    body = tmp_path / "body.parquet"
    pq.write_table(pa.table({"body": ["x"] * 3, "id": [1, 2, 3]}), body)
    msg = refusal(cfg_for(body))
    assert msg.startswith(f"data.sources[0] ({body}): {body} has no column 'text' (columns: body, id)"), msg
    # in a directory, every file's footer is read: a later file without the column, or of no rows, is refused too
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(300):
        pq.write_table(pa.table({"text": [words(20, i)]}), parts / f"part-{i:03d}.parquet")
    check_sources(cfg_for(parts))
    pq.write_table(pa.table({"content": ["x"]}), parts / "part-300.parquet")
    assert f"{parts / 'part-300.parquet'} has no column 'text' (columns: content)" in refusal(cfg_for(parts))
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), parts / "part-300.parquet")
    assert f"empty: {parts / 'part-300.parquet'} has no rows" in refusal(cfg_for(parts))
    (parts / "part-300.parquet").write_bytes(b"PAR1" + b"\0" * 64)  # a footer cut off: the file is named
    assert f"cannot read {parts / 'part-300.parquet'}: " in refusal(cfg_for(parts))
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), empty)
    assert f"empty: {empty} has no rows" in refusal(cfg_for(empty))
    blanks = tmp_path / "blanks.parquet"
    pq.write_table(pa.table({"text": ["", "  ", None]}), blanks)
    assert "no usable record in the first 3" in refusal(cfg_for(blanks))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1" + random.Random(1).randbytes(500))
    assert f"cannot read {broken}: " in refusal(cfg_for(broken))
    hub = DataConfig(sources=[SourceConfig(path="no-such-org/no-such-dataset", format="hub")])
    assert refusal(hub).startswith("data.sources[0] (no-such-org/no-such-dataset): cannot read it: ")


def test_ordinary_corpora_keep_the_document_level_split(tmp_path):
    lines = [words(30, i) for i in range(400)]
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(lines) + "\n")
    for kw in ({}, {"val_holdout": 0.0}, {"num_streams": 1, "val_holdout": 0.2}):
        assert plan_split(cfg_for(path, **kw), seq_len=32, seed=1, val_sequences=8).piece_chars == 0
    demo = DataConfig(cache_dir=str(tmp_path / "cache"), val_holdout=0.02)
    assert plan_split(demo, seq_len=128, seed=1234, val_sequences=64).piece_chars == 0
    # a corpus of a few long documents that the document-level split can serve is left alone too
    few = tmp_path / "few.txt"
    few.write_text("\n".join(words(3000, i) for i in range(64)) + "\n")
    few_cfg = cfg_for(few, num_streams=8, val_holdout=0.1)
    assert plan_split(few_cfg, seq_len=64, seed=0, val_sequences=4).piece_chars == 0


def test_a_single_huge_document_falls_back_to_pieces(tmp_path):
    huge = tmp_path / "huge.txt"
    huge.write_text(words(60_000))  # one line, no newline
    cfg = cfg_for(huge, num_streams=4, val_holdout=0.05)
    plan = check_corpus(cfg, seq_len=32, seed=3, val_sequences=8)
    assert plan.piece_chars == 128 and "sequence-level split" in plan.message and "\n" not in plan.message
    assert plan.message.startswith("data: 1 document (")
    assert check_corpus(cfg, seq_len=32, seed=3, val_sequences=8) == plan  # a pure function of the corpus
    # too little text even for pieces: refused in one line
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("just a few words\n")
    with pytest.raises(ConfigError, match=r"^data\.sources: too little text to train on: 1 document "):
        plan_split(cfg_for(tiny, num_streams=4), seq_len=32, seed=3, val_sequences=8)
    # enough documents, but a holdout too small to hold out anything: named as such
    many = tmp_path / "many.txt"
    many.write_text("\n".join(words(8, i) for i in range(40)) + "\n")
    with pytest.raises(ConfigError, match=r"^data\.val_holdout: 1e-06 of 40 documents "):
        plan_split(cfg_for(many, num_streams=4, val_holdout=1e-6), seq_len=32, seed=3, val_sequences=8)
    # validation sources that cannot fill one sequence
    ok = tmp_path / "ok.txt"
    ok.write_text("\n".join(words(30, i) for i in range(50)) + "\n")
    hi = tmp_path / "hi.txt"
    hi.write_text("hi\nhi\n")
    with pytest.raises(ConfigError, match=r"^data\.val_sources: too little text for validation: 1 distinct "):
        check_corpus(cfg_for(ok, val_sources=[SourceConfig(path=str(hi))]), seq_len=32, seed=3, val_sequences=8)
    assert (
        check_corpus(
            cfg_for(ok, val_sources=[SourceConfig(path=str(ok))]), seq_len=32, seed=3, val_sequences=8
        ).piece_chars
        == 0
    )


def test_pieces(tmp_path):
    text = words(2000, 5)
    pieces = list(cut_pieces(text, 100))
    assert all(0 < len(p) <= 100 and p.strip() for p in pieces)
    assert " ".join(pieces) == text  # cut at spaces, which are dropped
    assert list(cut_pieces("x" * 250, 100)) == ["x" * 100, "x" * 100, "x" * 50]
    assert list(cut_pieces("short", 100)) == ["short"]
    path = tmp_path / "one.txt"
    path.write_text(text + "\nsecond line\n")
    rows = list(read_lines([str(path)], "text", "text", piece_chars=100))
    assert [r["text"] for r in rows] == pieces + ["second line"]
    assert {r["line"] for r in rows[:-1]} == {1} and rows[-1]["line"] == 2


@pytest.fixture(scope="module")
def huge_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("huge")
    huge = d / "huge.txt"
    huge.write_text(words(40_000, 9))
    cfg = cfg_for(huge, num_streams=4, val_holdout=0.05, tokenizer_vocab_size=300, tokenizer_train_docs=2000)
    plan = plan_split(cfg, seq_len=32, seed=3, val_sequences=8)
    cfg.piece_chars = plan.piece_chars
    tok = load_or_train_tokenizer(cfg, d / "tok")
    return cfg, tok


def test_pieces_train_and_validate_deterministically_on_any_worker_count(huge_setup):
    cfg, tok = huge_setup
    assert cfg.piece_chars > 0 and len(tok) > 260

    def run(world: int) -> list[torch.Tensor]:
        plan = layout(world_size=world, global_batch=8, micro_cap=8, num_streams=cfg.num_streams, seq_len=32)
        parts = [TrainBatches(cfg, kind="decoder", tokenizer=tok, plan=plan, rank=r, seed=3) for r in range(world)]
        out = []
        for _ in range(3):
            rows = [row for p in parts for row in p.next_step()["input_ids"].tolist()]
            out.append(sorted(map(tuple, rows)))
        return out

    one = run(1)
    assert one == run(1) == run(2)  # deterministic; two workers serve the same global batches
    val = validation_sequences(cfg, kind="decoder", seq_len=32, tokenizer=tok, val_sequences=8, seed=3)
    again = validation_sequences(cfg, kind="decoder", seq_len=32, tokenizer=tok, val_sequences=8, seed=3)
    assert len(val) == 8 and all(torch.equal(a[0], b[0]) for a, b in zip(val, again))
    train_rows = {row for step in one for row in step}
    assert not train_rows & {tuple(x.tolist()) for x, _ in val}


def test_checkpoint_dir_must_be_creatable_and_writable(tmp_path):
    from pretrain.driver.prepare import check_writable_dir

    check_writable_dir(str(tmp_path / "new" / "deeper"), "checkpoint.dir")
    assert not (tmp_path / "new").exists()  # nothing created by the check
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match=rf"^checkpoint\.dir: {afile}/x: cannot create it: {afile} is not a dir"):
        check_writable_dir(str(afile / "x"), "checkpoint.dir")
    with pytest.raises(ConfigError, match=r"^checkpoint\.dir: /proc/pretrain-x: cannot create it in /proc"):
        check_writable_dir("/proc/pretrain-x", "checkpoint.dir")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="cannot write into it"):
            check_writable_dir(str(locked), "checkpoint.dir")


def test_preflight_checks_directories_and_the_vocab_size(tmp_path):
    from pretrain.config.paths import resolve_paths
    from pretrain.driver.prepare import preflight

    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(words(30, i) for i in range(100)) + "\n")
    base = [f"data.sources=[{{path: {corpus}}}]", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    cfg = resolve_paths(load_config(None, base))
    preflight(cfg)
    assert cfg.data.piece_chars == 0 and not (tmp_path / "ckpt").exists()
    for override, key in (
        ("model.vocab_size=100", "model.vocab_size"),
        (f"data.tokenizer={tmp_path}/none", "data.tokenizer"),
        (f"model.init_from_hf={tmp_path}/none", "model.init_from_hf"),
        (f"checkpoint.resume_from={tmp_path}/none", "checkpoint.resume_from"),
        *([("cluster.use_gpu=yes", "cluster.use_gpu")] if not Path("/dev/nvidiactl").exists() else []),
    ):
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            preflight(resolve_paths(load_config(None, [*base, override])))
    # experts from a dense Hugging Face model: refused before the run exists, with the upcycling that does it
    moe = ["model.init_from_hf=" + str(tmp_path), "moe.num_experts=4"]
    with pytest.raises(ConfigError, match=r"^model\.init_from_hf: a dense model .* grow RUN_ID experts=4$"):
        preflight(resolve_paths(load_config(None, [*base, *moe])))
