"""Tests of pretrain.data: demo corpus, tokenizer, packing, mixtures, virtual streams, exact and elastic
resume, bad records, MLM masking, validation holdout, unigram baseline, parquet sources."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import random
import zlib
from pathlib import Path

import pytest
import torch

from pretrain.config import DataConfig, SourceConfig, layout
from pretrain.data import (
    BadRecordError,
    TrainBatches,
    build_demo_corpus,
    data_throughput,
    load_or_train_tokenizer,
    merge_states,
    resolve_sources,
    training_documents,
    unigram_baseline_loss,
    validation_batches,
    validation_sequences,
)
from pretrain.data.packing import IGNORE_INDEX

WORDS = (
    "the a of to and in is that it for on with as was by be at this from or an are which but not have "
    "model data token stream packing river mountain garden window library engine signal theory "
    "naïve café Größe façade déjà señor smörgåsbord 東京 データ ☕ emoji🙂 tab\tseparated"
).split(" ")
T = 32


def make_docs(n: int, tag: str, seed: int = 0) -> list[str]:
    """Unique documents of very different lengths (some span several sequences)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = rng.choice([3, 5, 8, 12, 20, 40, 90]) if i % 17 else 250
        docs.append(f"{tag} {i}: " + " ".join(rng.choice(WORDS) for _ in range(k)))
    return docs


def write_txt(path: Path, docs: list[str], blank_every: int = 0) -> Path:
    lines = []
    for i, d in enumerate(docs):
        lines.append(d)
        if blank_every and i % blank_every == 0:
            lines.append("   ")  # blank lines of txt files are skipped silently
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def write_parquet(path: Path, texts: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": pa.array(texts, type=pa.string()), "n": list(range(len(texts)))}), path, row_group_size=97
    )
    return path


pytestmark = pytest.mark.usefixtures("datasets_cache")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    return write_txt(d / "docs.txt", make_docs(1500, "doc"), blank_every=50)


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    cfg = DataConfig(sources=[SourceConfig(path=str(corpus))], tokenizer_vocab_size=400, tokenizer_train_docs=1000)
    return load_or_train_tokenizer(cfg, tmp_path_factory.mktemp("tok"))


def data_cfg(*paths, **kw) -> DataConfig:
    base = dict(sources=[SourceConfig(path=str(p)) for p in paths], num_streams=4, val_holdout=0.0)
    base.update(kw)
    return DataConfig(**base)


def batches(cfg, tok, *, rank=0, world=1, G=8, kind="decoder", seed=7) -> TrainBatches:
    return TrainBatches(cfg, kind=kind, tokenizer=tok, plan=plan(cfg, world, G), rank=rank, seed=seed)


def plan(cfg, world: int, G: int, seq_len: int = T, val: int = 0):
    return layout(
        world_size=world, global_batch=G, micro_cap=G, num_streams=cfg.num_streams, seq_len=seq_len, val_sequences=val
    )


def steps(tb: TrainBatches, n: int) -> list[dict]:
    return [tb.next_step() for _ in range(n)]


def stream_tokens(all_steps: list[dict], owned: list[int], per_stream: int) -> dict[int, list[int]]:
    """Concatenated input_ids emitted by each stream over the given steps (decoder batches)."""
    out = {s: [] for s in owned}
    for b in all_steps:
        for j, s in enumerate(owned):
            for row in b["input_ids"][j * per_stream : (j + 1) * per_stream]:
                out[s].extend(row.tolist())
    return out


def complete_docs(tokens: list[int], tok) -> list[str]:
    """Decode the documents that lie completely inside an emitted token stream."""
    eos = tok.eos_token_id
    cuts = [i for i, t in enumerate(tokens) if t == eos]
    return [tok.decode(tokens[a + 1 : b]) for a, b in zip([-1, *cuts], cuts)][1:] if cuts else []


def rows(batch: dict) -> list[tuple]:
    return sorted(tuple(r) for r in batch["input_ids"].tolist())


# ----------------------------------------------------------------------------------------------
# Demo corpus and tokenizer
# ----------------------------------------------------------------------------------------------


def test_demo_corpus_is_real_deterministic_and_cached(tmp_path):
    a = build_demo_corpus(tmp_path / "a")
    b = build_demo_corpus(tmp_path / "b")
    data = a.read_bytes()
    assert len(data) >= 1_200_000
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(b.read_bytes()).hexdigest()
    text = data.decode("utf-8")
    lines = text.splitlines()
    assert len(lines) > 5000 and all(line.strip() for line in lines)
    assert len(set(lines)) == len(lines)
    assert sum(c.isalpha() or c == " " for c in text) / len(text) > 0.9
    common = collections.Counter(w.lower() for w in text.split()).most_common(5)
    assert {"the", "a", "of", "to", "is"} & {w for w, _ in common}
    mtime = a.stat().st_mtime_ns
    assert build_demo_corpus(tmp_path / "a") == a and a.stat().st_mtime_ns == mtime  # reused
    a.write_text("corrupted\n")
    assert build_demo_corpus(tmp_path / "a").read_bytes() == data  # checksum mismatch: rebuilt


def test_demo_source_resolves_under_cache_dir(tmp_path, monkeypatch, tok):
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(cache_dir="rel_cache", num_streams=2)  # default sources: [demo]
    (src,) = resolve_sources(cfg.sources, cfg.cache_dir)
    assert Path(src.files[0]) == (tmp_path / "rel_cache" / "demo_corpus_v1.txt").resolve()
    b = batches(cfg, tok, G=4).next_step()
    assert b["input_ids"].shape == (4, T)


def test_tokenizer_deterministic_roundtrip_specials(corpus, tok, tmp_path):
    cfg = DataConfig(sources=[SourceConfig(path=str(corpus))], tokenizer_vocab_size=400, tokenizer_train_docs=1000)
    again = load_or_train_tokenizer(cfg)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert len(tok) == 400
    specials = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|pad|>", "<|mask|>", "<|unk|>")}
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert (tok.pad_token, tok.mask_token, tok.unk_token) == ("<|pad|>", "<|mask|>", "<|unk|>")
    assert set(specials.values()) == set(tok.all_special_ids) and len(set(specials.values())) == 4
    for s in ["naïve café 東京 ☕🙂", "  leading and\ttabs\n\nand newlines  ", "Ünïcödé — “quotes” 𝔘 \u200b end"]:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.bos_token_id not in ids
        assert tok.decode(ids) == s
    # the saved directory loads through data.tokenizer
    saved = tmp_path / "saved"
    load_or_train_tokenizer(cfg, saved)
    loaded = load_or_train_tokenizer(DataConfig(tokenizer=str(saved)))
    assert loaded("déjà vu")["input_ids"] == tok("déjà vu")["input_ids"]
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_or_train_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing")))


# ----------------------------------------------------------------------------------------------
# Packing, mixtures, virtual streams
# ----------------------------------------------------------------------------------------------


def test_packing_loses_and_duplicates_nothing(corpus, tok):
    cfg = data_cfg(corpus)
    tb = batches(cfg, tok, G=8)
    got = steps(tb, 30)
    assert all(b["input_ids"].shape == (8, T) and b["input_ids"].dtype == torch.int64 for b in got)
    assert all(torch.equal(b["input_ids"], b["labels"]) for b in got)  # decoder: the model shifts
    docs = list(training_documents(cfg, seed=7))
    assert len(docs) == 1500
    eos = tok.eos_token_id
    for s, tokens in stream_tokens(got, [0, 1, 2, 3], 2).items():
        expected = []
        for ids in tok(docs[s::4], add_special_tokens=False)["input_ids"]:
            expected.extend([*ids, eos])
        assert len(tokens) == 30 * 2 * T
        assert tokens == expected[: len(tokens)]  # exact order, every document followed by eos
        assert complete_docs(tokens, tok) == docs[s::4][1 : len(complete_docs(tokens, tok)) + 1]


def test_repeat_restarts_streams_and_no_repeat_stops(tmp_path, tok):
    small = write_txt(tmp_path / "small.txt", make_docs(40, "tiny", seed=3))
    cfg = data_cfg(small, num_streams=2)
    docs = list(training_documents(cfg))
    eos = tok.eos_token_id
    per_epoch = {
        s: [t for ids in tok(docs[s::2], add_special_tokens=False)["input_ids"] for t in (*ids, eos)] for s in range(2)
    }
    tb = batches(cfg, tok, G=2)
    need = 3 * max(len(v) for v in per_epoch.values()) // T + 2
    got = steps(tb, need)
    for s, tokens in stream_tokens(got, [0, 1], 1).items():
        assert tokens == (per_epoch[s] * 4)[: len(tokens)]
    assert all(v["epoch"] >= 2 for v in tb.state_dict()["streams"].values())

    tb = batches(data_cfg(small, num_streams=2, repeat=False), tok, G=2)
    n = 0
    with pytest.raises(StopIteration):
        while True:
            tb.next_step()
            n += 1
    assert n == min(len(v) for v in per_epoch.values()) // T


def test_mixture_weights_and_seed(tmp_path):
    a = write_txt(tmp_path / "a.txt", make_docs(3000, "alpha"))
    b = write_jsonl(tmp_path / "b.jsonl", make_docs(3000, "beta"))
    cfg = DataConfig(
        sources=[SourceConfig(path=str(a), weight=3.0), SourceConfig(path=str(b), weight=1.0)], val_holdout=0.0
    )
    first = [d.split()[0] for d in training_documents(cfg, seed=1, limit=2400)]
    share = first.count("alpha") / len(first)
    assert 0.72 < share < 0.78
    assert first == [d.split()[0] for d in training_documents(cfg, seed=1, limit=2400)]
    assert first != [d.split()[0] for d in training_documents(cfg, seed=2, limit=2400)]
    # all_exhausted: a full pass sees every document of both sources at least once
    full = list(training_documents(cfg, seed=1))
    assert set(full) == set(make_docs(3000, "alpha")) | set(make_docs(3000, "beta"))


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_world_size_independence_and_disjointness(corpus, tok, kind):
    cfg = data_cfg(corpus, mlm_probability=0.15)
    one = batches(cfg, tok, kind=kind, G=8)
    two = [batches(cfg, tok, kind=kind, G=8, rank=r, world=2) for r in range(2)]
    s1, s2 = steps(one, 12), [steps(w, 12) for w in two]
    for step in range(12):
        b1, w0, w1 = s1[step], s2[0][step], s2[1][step]
        assert w0["input_ids"].shape == w1["input_ids"].shape == (4, T)
        merged = {k: torch.cat([w0[k], w1[k]]) for k in w0}
        assert rows(merged) == rows(b1)
        # micro-batch = G/S = 2: worker 0 holds streams 0 and 2, worker 1 streams 1 and 3
        for key in ("input_ids", "labels"):
            for j, (w, local) in enumerate([(w0, 0), (w1, 0), (w0, 1), (w1, 1)]):
                assert torch.equal(w[key][local * 2 : (local + 1) * 2], b1[key][j * 2 : (j + 1) * 2])
    if kind == "decoder":
        per = [stream_tokens(s2[r], [r, r + 2], 2) for r in range(2)]
        docs = [{d for toks in p.values() for d in complete_docs(toks, tok)} for p in per]
        single = {d for toks in stream_tokens(s1, [0, 1, 2, 3], 2).values() for d in complete_docs(toks, tok)}
        assert docs[0] and docs[1] and not docs[0] & docs[1]
        assert docs[0] | docs[1] == single


# ----------------------------------------------------------------------------------------------
# Exact and elastic resume
# ----------------------------------------------------------------------------------------------


def resume_sources(tmp_path: Path) -> list[Path]:
    t = write_txt(tmp_path / "r.txt", make_docs(40, "txt", seed=5))
    j = tmp_path / "r.jsonl"
    write_jsonl(j, make_docs(30, "json", seed=6))
    with open(j, "ab") as f:  # a few bad records inside the mixture
        f.write(b'{"text": 5}\n{broken\n\xff\xfe\n{"text": "  "}\n')
        f.write(("".join(json.dumps({"text": d}) + "\n" for d in make_docs(10, "tail", seed=8))).encode())
    p = write_parquet(tmp_path / "r.parquet", make_docs(30, "pq", seed=9) + [None, "", "pq last one"])
    return [t, j, p]


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_prefetch_keeps_batches_and_the_state_of_the_batches_taken(tmp_path, tok, kind):
    """``prefetch()`` (the trainer's, while a step computes) changes no batch and no order; with a batch ahead,
    ``state_dict()`` and the bad-record counts are still those of the batches taken, so a checkpoint resumes at the
    next untrained batch; the end of the data (repeat off) surfaces at the same step."""
    paths = resume_sources(tmp_path)
    cfg = DataConfig(
        sources=[SourceConfig(path=str(p), weight=w) for p, w in zip(paths, (2.0, 1.0, 1.0))],
        num_streams=4,
        val_holdout=0.05,
    )
    plain, ahead = batches(cfg, tok, kind=kind), batches(cfg, tok, kind=kind)
    for n in range(30):
        a, b = plain.next_step(), ahead.next_step()
        assert all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels")), n
        ahead.prefetch()
        ahead.prefetch()  # idempotent: still one batch ahead
        assert ahead.state_dict() == plain.state_dict(), n
        assert ahead.bad_record_summary() == plain.bad_record_summary(), n
    state = roundtrip(ahead.state_dict())  # a checkpoint with a batch in flight
    fresh = batches(cfg, tok, kind=kind)
    fresh.load_state_dict(state)
    for _ in range(5):
        a, b, c = plain.next_step(), ahead.next_step(), fresh.next_step()
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in ("input_ids", "labels"))
        ahead.prefetch()
    ahead.load_state_dict(state)  # a resume drops the batch ahead
    assert ahead.state_dict() == state

    small = write_txt(tmp_path / "small.txt", make_docs(30, "s", seed=3))
    ends = []
    for prefetch in (False, True):
        tb = batches(data_cfg(small, num_streams=2, repeat=False), tok, G=2, kind=kind)
        taken = 0
        with pytest.raises(StopIteration):
            while True:
                tb.next_step()
                taken += 1
                if prefetch:
                    tb.prefetch()
        ends.append((taken, tb.state_dict()))
    assert ends[0] == ends[1]


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_exact_resume_same_and_across_world_sizes(tmp_path, tok, kind):
    paths = resume_sources(tmp_path)
    cfg = DataConfig(
        sources=[SourceConfig(path=str(p), weight=w) for p, w in zip(paths, (2.0, 1.0, 1.0))],
        num_streams=4,
        val_holdout=0.05,
    )
    N, M = 40, 20  # small sources: the continuation crosses epoch boundaries

    ref1 = batches(cfg, tok, kind=kind)
    ref1_steps = steps(ref1, N + M)
    ref2 = [batches(cfg, tok, kind=kind, rank=r, world=2) for r in range(2)]
    ref2_steps = [steps(w, N + M) for w in ref2]
    epochs = [v["epoch"] for v in ref1.state_dict()["streams"].values()]
    assert max(epochs) >= 1
    assert ref1.bad_record_summary()["by_source"] == {str(paths[1]): 4, str(paths[2]): 2}

    def same(a, b):
        return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in ("input_ids", "labels"))

    # same world size (1), through JSON
    w = batches(cfg, tok, kind=kind)
    steps(w, N)
    state = roundtrip(w.state_dict())
    fresh = batches(cfg, tok, kind=kind)
    fresh.load_state_dict(state)
    assert same(steps(fresh, M), ref1_steps[N:])
    assert fresh.bad_record_summary() == ref1.bad_record_summary()
    # 2 -> 1
    ws = [batches(cfg, tok, kind=kind, rank=r, world=2) for r in range(2)]
    for x in ws:
        steps(x, N)
    merged = roundtrip(merge_states([x.state_dict() for x in ws]))
    single = batches(cfg, tok, kind=kind)
    single.load_state_dict(merged)
    assert same(steps(single, M), ref1_steps[N:])
    # the bare union of the per-rank "streams" (what the checkpoint loader builds) works as well
    bare = batches(cfg, tok, kind=kind)
    bare.load_state_dict({"streams": {k: v for x in ws for k, v in roundtrip(x.state_dict())["streams"].items()}})
    assert same(steps(bare, M), ref1_steps[N:])
    # 1 -> 2
    w = batches(cfg, tok, kind=kind)
    steps(w, N)
    state = roundtrip(w.state_dict())
    for r in range(2):
        x = batches(cfg, tok, kind=kind, rank=r, world=2)
        x.load_state_dict(state)
        assert same(steps(x, M), ref2_steps[r][N:])
    # a worker cannot resume from a state that lacks its streams, or from another sequence length
    with pytest.raises(ValueError, match="streams"):
        batches(cfg, tok, kind=kind).load_state_dict(roundtrip(ws[0].state_dict()))
    with pytest.raises(ValueError, match="seq_len"):
        TrainBatches(
            cfg, kind=kind, tokenizer=tok, plan=plan(cfg, 1, 8, seq_len=T * 2), rank=0, seed=7
        ).load_state_dict({"streams": merged["streams"]})


# ----------------------------------------------------------------------------------------------
# Bad records
# ----------------------------------------------------------------------------------------------


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


def drain(tb: TrainBatches) -> int:
    n = 0
    try:
        while True:
            tb.next_step()
            n += 1
    except StopIteration:
        return n


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


# ----------------------------------------------------------------------------------------------
# MLM masking, validation, baseline, parquet, throughput
# ----------------------------------------------------------------------------------------------


def test_mlm_masking(corpus, tok):
    cfg = data_cfg(corpus, mlm_probability=0.15)
    enc = steps(batches(cfg, tok, kind="encoder", G=16), 20)
    dec = steps(batches(cfg, tok, kind="decoder", G=16), 20)
    x = torch.cat([b["input_ids"] for b in enc])
    y = torch.cat([b["labels"] for b in enc])
    orig = torch.cat([b["input_ids"] for b in dec])
    special = torch.zeros(len(tok), dtype=torch.bool)
    special[tok.all_special_ids] = True
    selected = y != IGNORE_INDEX
    assert torch.equal(y[selected], orig[selected])
    assert torch.equal(x[~selected], orig[~selected])
    assert not selected[special[orig]].any()  # separators never predicted
    assert special[orig].any()
    rate = selected.sum().item() / (~special[orig]).sum().item()
    assert 0.13 < rate < 0.17
    xs, os_ = x[selected], orig[selected]
    masked = (xs == tok.mask_token_id).float().mean().item()
    kept = (xs == os_).float().mean().item()
    replaced = xs[(xs != tok.mask_token_id) & (xs != os_)]
    assert 0.77 < masked < 0.83 and 0.08 < kept < 0.13
    assert 0.07 < replaced.numel() / xs.numel() < 0.12
    assert not special[replaced].any() and replaced.max() < len(tok)
    # masks do not depend on the worker count
    two = [steps(batches(cfg, tok, kind="encoder", G=16, rank=r, world=2), 3) for r in range(2)]
    for step in range(3):
        merged = torch.cat([two[0][step]["labels"], two[1][step]["labels"]])
        assert sorted(map(tuple, merged.tolist())) == sorted(map(tuple, enc[step]["labels"].tolist()))


def test_validation_holdout_and_sources(corpus, tok, tmp_path):
    cfg = data_cfg(corpus, val_holdout=0.2, repeat=False)
    val = validation_sequences(cfg, kind="decoder", seq_len=T, tokenizer=tok, val_sequences=40, seed=7)
    assert len(val) == 40
    val_docs = {d for x, _ in val for d in complete_docs(x.tolist(), tok)}
    assert val_docs and all(zlib.crc32(d.encode()) % 1_000_000 < 200_000 for d in val_docs)
    train = list(training_documents(cfg, seed=7))
    assert 1500 * 0.15 < 1500 - len(train) < 1500 * 0.25
    assert not val_docs & set(train)
    tb = batches(cfg, tok, G=8)
    seen = {
        d
        for toks in stream_tokens(steps(tb, drain_count(cfg, tok)), [0, 1, 2, 3], 2).values()
        for d in complete_docs(toks, tok)
    }
    assert seen and not seen & val_docs
    # workers split the same set as the plan says (sequences r::W), in micro-batches
    one = validation_batches(cfg, kind="encoder", seq_len=T, tokenizer=tok, val_sequences=40, micro_batch=8, seed=7)
    assert [b["input_ids"].shape[0] for b in one] == [8] * 5
    two_plan = plan(cfg, 2, 8, val=40)
    assert two_plan.val_shares == (20, 20)
    two = [
        validation_batches(
            cfg,
            kind="encoder",
            seq_len=T,
            tokenizer=tok,
            val_sequences=40,
            micro_batch=8,
            seed=7,
            part=two_plan.val_part(r),
        )
        for r in range(2)
    ]
    all_one = torch.cat([b["labels"] for b in one])
    assert torch.equal(torch.cat([b["labels"] for b in two[0]]), all_one[0::2])
    assert torch.equal(torch.cat([b["labels"] for b in two[1]]), all_one[1::2])
    again = validation_batches(cfg, kind="encoder", seq_len=T, tokenizer=tok, val_sequences=40, micro_batch=8, seed=7)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(one, again))
    # short validation stream: what there is; none at all: a clear error; disabled: []
    assert (
        0
        < len(validation_sequences(cfg, kind="decoder", seq_len=T, tokenizer=tok, val_sequences=10**6, seed=7))
        < 10**6
    )
    tiny = write_txt(tmp_path / "tiny_val.txt", ["too short"])
    with pytest.raises(ValueError, match="validation"):
        validation_sequences(
            data_cfg(corpus, val_sources=[SourceConfig(path=str(tiny))]),
            kind="decoder",
            seq_len=T,
            tokenizer=tok,
            val_sequences=4,
            seed=7,
        )
    assert (
        validation_batches(
            data_cfg(corpus), kind="decoder", seq_len=T, tokenizer=tok, val_sequences=4, micro_batch=2, seed=7
        )
        == []
    )
    vs = write_txt(tmp_path / "val.txt", make_docs(60, "heldout", seed=11))
    cfg_vs = data_cfg(corpus, val_sources=[SourceConfig(path=str(vs))], val_holdout=0.5)
    val = validation_sequences(cfg_vs, kind="decoder", seq_len=T, tokenizer=tok, val_sequences=8, seed=7)
    assert len(val) == 8 and all(d.startswith("heldout") for x, _ in val for d in complete_docs(x.tolist(), tok))
    assert len(list(training_documents(cfg_vs))) == 1500  # val_sources given: no holdout from training


def drain_count(cfg: DataConfig, tok) -> int:
    return drain(batches(cfg, tok, G=8))


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_unigram_baseline(corpus, tok, kind):
    cfg = data_cfg(corpus, val_holdout=0.1)
    loss = unigram_baseline_loss(cfg, kind=kind, seq_len=T, tokenizer=tok, val_sequences=32, seed=7)
    assert math.isfinite(loss) and 1.0 < loss < math.log(len(tok))


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


def test_data_throughput_is_positive(corpus, tok):
    cfg = data_cfg(corpus)
    threads = torch.get_num_threads()
    assert data_throughput(cfg, kind="decoder", seq_len=T, tokenizer=tok, seconds=0.3) > 1000
    assert data_throughput(cfg, kind="encoder", seq_len=T, tokenizer=tok, seconds=0.3) > 1000
    assert torch.get_num_threads() == threads  # restored after measuring with one thread
