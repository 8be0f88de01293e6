"""A virtual stream's shuffle buffer (``data.shuffle_sequences``, ``pretrain/data/packed_stream.py``): the same
sequences as packing order, in another order; the same for any worker count; exact on resume through JSON, with a
batch prefetched and across worker counts; drained at the end of the data; a resume with another buffer size is
refused."""

from __future__ import annotations

import json

import pytest
import torch

from pretrain.data import merge_states
from tests.unit.data.common import T, batches, data_cfg, drain, steps

pytestmark = pytest.mark.usefixtures("datasets_cache")


def _rows(all_steps: list[dict]) -> list[tuple]:
    return [tuple(r) for b in all_steps for r in b["input_ids"].tolist()]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in ("input_ids", "labels"))


def _pass(cfg, tok, **kw) -> list[dict]:
    tb, out = batches(cfg, tok, **kw), []
    try:
        while True:
            out.append(tb.next_step())
    except StopIteration:
        return out


def test_a_shuffled_pass_is_the_same_sequences_in_another_order(corpus, tok):
    # one stream (with several, a pass ends when the shortest stream does, and the others hold more in the buffer)
    plain = _pass(data_cfg(corpus, repeat=False, num_streams=1), tok, G=1)
    shuffled = _pass(data_cfg(corpus, repeat=False, num_streams=1, shuffle_sequences=16), tok, G=1)
    assert len(plain) > 100 and len(shuffled) == len(plain), "the buffer is drained at the end of the data"
    assert sorted(_rows(shuffled)) == sorted(_rows(plain)), "every sequence once"
    assert _rows(shuffled) != _rows(plain)
    # how far a sequence moved: the buffer's reach, not a permutation of the whole pass
    where = {r: i for i, r in enumerate(_rows(plain))}
    moved = [abs(where[r] - i) for i, r in enumerate(_rows(shuffled))]
    assert 4 < sum(moved) / len(moved) < 16 * 2
    other = _pass(data_cfg(corpus, repeat=False, num_streams=1, shuffle_sequences=16), tok, G=1, seed=8)
    assert _rows(other) != _rows(shuffled), "the order follows the seed"


@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_shuffled_batches_resume_exactly_for_any_worker_count(corpus, tok, kind):
    cfg = data_cfg(corpus, shuffle_sequences=8, mlm_probability=0.15)
    N, M = 12, 8
    ref = steps(batches(cfg, tok, kind=kind), N + M)
    two = [batches(cfg, tok, kind=kind, rank=r, world=2) for r in range(2)]
    halves = [steps(w, N + M) for w in two]
    for step in range(N + M):  # worker 0 holds streams 0 and 2, worker 1 streams 1 and 3, G/S = 2 each
        w0, w1 = halves[0][step], halves[1][step]
        order = [w0["input_ids"][:2], w1["input_ids"][:2], w0["input_ids"][2:], w1["input_ids"][2:]]
        assert torch.equal(torch.cat(order), ref[step]["input_ids"]), step

    # a checkpoint with a batch prefetched, through JSON, resumes at the next untrained batch
    w = batches(cfg, tok, kind=kind)
    steps(w, N)
    w.prefetch()
    state = json.loads(json.dumps(w.state_dict()))
    assert all(len(s["shuffle_buffer"]) >= 8 and len(s["shuffle_buffer"][0]) == T for s in state["streams"].values())
    fresh = batches(cfg, tok, kind=kind)
    fresh.load_state_dict(state)
    assert _same(steps(fresh, M), ref[N:])
    # two workers' states, merged, resume one worker
    for x in two:
        x.load_state_dict(state)
    one = batches(cfg, tok, kind=kind)
    one.load_state_dict(json.loads(json.dumps(merge_states([x.state_dict() for x in two]))))
    assert _same(steps(one, M), ref[N:])
    # another buffer size means another order: refused by name
    with pytest.raises(ValueError, match="shuffle_sequences was 8, now 4"):
        batches(data_cfg(corpus, shuffle_sequences=4), tok, kind=kind).load_state_dict(state)


def test_no_buffer_keeps_packing_order_and_state(corpus, tok):
    tb = batches(data_cfg(corpus), tok)
    steps(tb, 3)
    state = tb.state_dict()
    assert all("shuffle_buffer" not in s and s["shuffle_sequences"] == 0 for s in state["streams"].values())
    assert drain(batches(data_cfg(corpus, repeat=False, shuffle_sequences=4), tok)) > 0


def test_a_resume_reads_the_documents_the_run_it_continues_read(tmp_path, tok):
    """Short documents (many to a sequence) with bad records among them: a resumed stream reads ahead as the run it
    continues did (how many documents a fill reads depends on a running chars/token estimate, saved with the
    stream), so its whole position after each step is the uninterrupted run's: the same bad records met by then
    (where ``data.bad_records=fail`` stops)."""
    lines = [json.dumps({"text": f"w{i} " * (1 + i % 5)}) for i in range(600)]
    for i in range(7, 600, 29):
        lines[i] = "{broken"
    path = tmp_path / "short.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = data_cfg(path, num_streams=2)
    ref = batches(cfg, tok)
    positions = []
    for _ in range(12):
        ref.next_step()
        positions.append(json.loads(json.dumps(ref.state_dict())))
    for n in (1, 5):
        resumed = batches(cfg, tok)
        resumed.load_state_dict(positions[n - 1])
        for k in range(n, 12):
            resumed.next_step()
            assert json.loads(json.dumps(resumed.state_dict())) == positions[k], (n, k)
