"""The remote-code model in ``transformers``: padding masks (right and left) and batched generation. Which
directories may run that code is ``test_remote.py``; parity with our model, ``test_hf.py``."""

from __future__ import annotations

import torch

from pretrain.export.hf import export_model, load_exported
from pretrain.export.parity import parity_batch
from tests.unit.export.test_hf import NAMED, one_thread, perturbed_state  # noqa: F401 - the autouse fixture


def test_remote_code_padding_mask(tokenizer, tmp_path):
    """Right padding does not change the logits of the real tokens (decoder and encoder); nor does left padding
    those of a decoder with learned positions, in a forward or in batched greedy generation."""
    for kind, name in (("decoder", "remote-gpt2-with-bias"), ("encoder", "remote-prenorm-rotary-encoder")):
        cfg, _ = NAMED[name]
        export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / kind, log=lambda *a: None)
        hf = load_exported(tmp_path / kind, kind)
        ids = parity_batch(cfg, batch=1, seq_len=10)
        padded = torch.cat([ids, torch.full((1, 4), tokenizer.pad_token_id)], dim=1)
        mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 4)], dim=1).long()
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
            got = hf(input_ids=padded, attention_mask=mask).logits[:, :10]
        assert (got - ref).abs().max() < 1e-5, kind
    # left padding (batched generation): the decoder's learned positions count the real tokens only, so a padded
    # prompt in a batch continues as it does alone
    hf = load_exported(tmp_path / "decoder", "decoder")
    ids = parity_batch(NAMED["remote-gpt2-with-bias"][0], batch=1, seq_len=10)
    left = torch.cat([torch.full((1, 4), tokenizer.pad_token_id), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 10)], dim=1).long()
    with torch.no_grad():
        assert (hf(input_ids=left, attention_mask=mask).logits[:, 4:] - hf(input_ids=ids).logits).abs().max() < 1e-5
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    alone = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)[:, 10:]
    batch = torch.cat([left, torch.cat([ids[:, :4], ids], dim=1)])  # beside a longer prompt
    both = hf.generate(input_ids=batch, attention_mask=torch.cat([mask, torch.ones(1, 14).long()]), **kw)
    assert torch.equal(both[:1, 14:], alone)
