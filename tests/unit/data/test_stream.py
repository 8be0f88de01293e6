"""Mixtures, the validation holdout and virtual document streams (``pretrain/data/stream.py``): repeats, mixture
weights, world-size independence, prefetch, exact and elastic resume. The shared corpus, tokenizer and helpers of
the ``pretrain/data`` tests are in ``conftest.py`` and ``common.py`` beside this file."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, DataConfig, SourceConfig
from pretrain.data import TrainBatches, merge_states, training_documents, validation_batches, validation_sequences
from tests.unit.data.common import (
    T,
    batches,
    complete_docs,
    data_cfg,
    drain,
    make_docs,
    plan,
    rows,
    steps,
    stream_tokens,
    write_jsonl,
    write_parquet,
    write_txt,
)

pytestmark = pytest.mark.usefixtures("datasets_cache")


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

    # a run that ran out of data, resumed with data.repeat=true: its streams go on with the next pass
    resumed = batches(data_cfg(small, num_streams=2), tok, G=2)
    resumed.load_state_dict(json.loads(json.dumps(tb.state_dict())))
    assert len(steps(resumed, need)) == need
    assert all(v["epoch"] >= 1 for v in resumed.state_dict()["streams"].values())


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
    with pytest.raises(ConfigError, match="validation"):
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
