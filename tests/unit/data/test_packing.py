"""Packing documents into sequences and MLM masking (``pretrain/data/packing.py``)."""

from __future__ import annotations

import pytest
import torch

from pretrain.data import training_documents
from pretrain.data.packing import IGNORE_INDEX
from tests.unit.data.common import T, batches, complete_docs, data_cfg, steps, stream_tokens

pytestmark = pytest.mark.usefixtures("datasets_cache")


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


def test_token_documents_pack_like_the_same_text_and_resume_from_the_json_buffer():
    """A document that is already tokens (a shard's uint16 view) packs exactly as its text would, mixed in any order
    with text documents, and the buffer's JSON form resumes the same sequences."""
    import json
    import random

    import numpy as np

    from pretrain.data.packing import Packer

    rng = random.Random(0)
    texts = ["".join(chr(97 + rng.randrange(26)) for _ in range(rng.randrange(0, 60))) for _ in range(800)]

    def encode(batch):
        return [[ord(c) for c in t] for t in batch]

    mixed = [np.array(encode([t])[0], dtype=np.uint16) if i % 3 else t for i, t in enumerate(texts)]
    want = Packer(iter(texts), encode, 0, 48)
    got = Packer(iter(mixed), encode, 0, 48)
    n = 0
    while True:
        try:
            w = want.next_sequence()
        except StopIteration:
            w = None
        try:
            g = got.next_sequence()
        except StopIteration:
            g = None
        if w is None or g is None:
            assert w is None and g is None
            break
        assert g.dtype == np.int64 and g.tolist() == w.tolist()
        n += 1
        if n == 40:  # resume from the serialized buffer
            got = Packer(got.docs, encode, 0, 48, json.loads(json.dumps(got.buffer.tolist())))
    assert n > 80
