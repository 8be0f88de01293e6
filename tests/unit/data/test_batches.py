"""Training batches, per-source validation and the data-throughput probe (``pretrain/data/batches.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config import SourceConfig
from pretrain.data import BadRecordError, data_throughput
from pretrain.data.bad_records import BadRecords, summarize_bad_records, summary_line
from pretrain.data.batches import source_validation_batches, validation_batches
from tests.unit.data.common import T, data_cfg, make_docs, write_jsonl, write_txt

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_data_throughput_is_positive(corpus, tok):
    cfg = data_cfg(corpus)
    threads = torch.get_num_threads()
    assert data_throughput(cfg, kind="decoder", seq_len=T, tokenizer=tok, seconds=0.3) > 1000
    assert data_throughput(cfg, kind="encoder", seq_len=T, tokenizer=tok, seconds=0.3) > 1000
    assert torch.get_num_threads() == threads  # restored after measuring with one thread


def test_per_source_validation_skips_a_source_too_small_and_raises_its_bad_records(tmp_path, corpus, tok):
    small = write_txt(tmp_path / "small.txt", ["a few words only"])
    broken = write_jsonl(tmp_path / "broken.jsonl", make_docs(50, "b"))
    broken.write_text("{broken\n" + broken.read_text())
    args = dict(kind="decoder", seq_len=T, tokenizer=tok, val_sequences=4, micro_batch=2, seed=0)
    cfg = data_cfg(corpus, val_sources=[SourceConfig(path=str(corpus)), SourceConfig(path=str(small))])
    sets, skipped = source_validation_batches(cfg, **args)
    assert list(sets) == ["docs"] and skipped == ["small"]
    failing = dataclasses.replace(cfg, val_sources=[cfg.val_sources[0], SourceConfig(path=str(broken))])
    with pytest.raises(BadRecordError, match=rf"^{broken}:1: invalid JSON"):
        source_validation_batches(dataclasses.replace(failing, bad_records="fail"), **args)


def test_the_validation_sets_bad_records_reach_the_callers_counter(tmp_path, corpus, tok):
    val = write_jsonl(tmp_path / "val.jsonl", make_docs(60, "v"))
    val.write_text(val.read_text().replace('{"text": "v 0:', '{"txt": "v 0:', 1))
    cfg = data_cfg(corpus, val_sources=[SourceConfig(path=str(val))])
    bad = BadRecords(cfg.bad_records)
    assert validation_batches(
        cfg, kind="decoder", seq_len=T, tokenizer=tok, val_sequences=4, micro_batch=2, seed=0, bad=bad
    )
    assert summary_line(summarize_bad_records([bad])) == (
        f"1 bad record(s) skipped (1 missing_field); first: {val}:1: missing text field ('text')"
    )


def test_fewer_validation_sequences_than_data_parallel_workers_is_refused(tmp_path, corpus, tok):
    """Every data-parallel worker validates its own part in collective forwards: a set too small to give each one a
    sequence is refused in one line on every worker (per source: that source is skipped), never a worker without
    a sequence skipping the validation the others run."""
    few = write_txt(tmp_path / "few.txt", [" ".join(f"w{i}" for i in range(T))])  # a few sequences
    args = dict(kind="decoder", seq_len=T, tokenizer=tok, val_sequences=64, micro_batch=1, seed=0)
    cfg = data_cfg(corpus, val_sources=[SourceConfig(path=str(few))])
    n = len(validation_batches(cfg, **args))  # sequences: one a micro-batch
    assert 1 <= n < 8
    for rank in range(n):  # as many workers as sequences: one each
        assert validation_batches(cfg, **args, part=slice(rank, 64, n))
    for rank in range(n + 1):
        given = rf"^validation: data.val_sources gives {n} sequence\(s\) of seq_len=.*: add data to data.val_sources$"
        with pytest.raises(ValueError, match=given):  # (data.val_holdout would change nothing here)
            validation_batches(cfg, **args, part=slice(rank, 64, n + 1))
    both = data_cfg(corpus, val_sources=[SourceConfig(path=str(corpus)), SourceConfig(path=str(few))])
    sets, skipped = source_validation_batches(both, **args, part=slice(0, 64, n + 1))
    assert list(sets) == ["docs"] and skipped == ["few"]


def test_bad_rows_are_ordered_by_number():
    """Parquet and hub datasets name a bad record by its row: the first is the lowest row, not the first as text."""
    bad = BadRecords("skip")
    for row in (100, 10, 2):
        bad.add({"file": "a.parquet", "line": f"row {row}", "msg": "missing text field", "bad": "missing_field"})
    bad.add({"file": "a.jsonl", "line": 7, "msg": "invalid JSON", "bad": "invalid_json"})
    assert summarize_bad_records([bad])["examples"] == [
        "a.jsonl:7: invalid JSON",
        "a.parquet:row 2: missing text field",
        "a.parquet:row 10: missing text field",
        "a.parquet:row 100: missing text field",
    ]


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_step_that_never_trains_is_put_back_on_every_worker(tmp_path, tok, prefetch):
    """``data.repeat=false``: the step at which one worker's data ends trains on no worker, and a worker whose data
    lasts took its share already; put back (``rewind``), every stream's position is the one-worker run's, so a
    resume of the stop's checkpoint (with ``data.repeat=true``) reads the same data on any worker count."""
    import dataclasses as dc

    from pretrain.data.batches import merge_states
    from tests.unit.data.common import batches

    cfg = data_cfg(write_txt(tmp_path / "small.txt", make_docs(160, "s")), repeat=False)

    def to_the_end(parts) -> dict:  # as the trainer drives them: every rank asks, one collective says who ended
        while True:
            got = []
            for p in parts:
                try:
                    got.append(p.next_step())
                    if prefetch:
                        p.prefetch()
                except StopIteration:
                    got.append(None)
            if any(g is None for g in got):
                for p, g in zip(parts, got):
                    if g is not None:
                        p.rewind()
                return merge_states([p.state_dict() for p in parts])

    one = to_the_end([batches(cfg, tok, world=1)])
    two = to_the_end([batches(cfg, tok, rank=r, world=2) for r in (0, 1)])
    assert {s: st["sequences"] for s, st in two["streams"].items()} == {
        s: st["sequences"] for s, st in one["streams"].items()
    }
    again = dc.replace(cfg, repeat=True)
    resumed = []
    for state in (one, two):
        tb = batches(again, tok, world=1)
        tb.load_state_dict(state)
        resumed.append(tb.next_step()["input_ids"])
    assert torch.equal(resumed[0], resumed[1])
