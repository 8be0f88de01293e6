"""Loading a decoder to sample from (``eval/generator.py``): in bf16 or fp16 the parameters are cast and the fp32
buffers are not, as ``from_pretrained(dtype=...)`` leaves them. Loading from runs, checkpoints and exports through
the CLI is in ``tests/integration/checkpoint/test_export.py``."""

from __future__ import annotations

import torch

from eval.generator import on_device
from pretrain.export.hf import to_hf_model
from tests.unit.export.test_hf import LLAMA_CFG, perturbed_state, tiny


def test_half_precision_casts_the_weights_and_keeps_the_rope_frequencies_fp32():
    cfg = tiny(LLAMA_CFG, num_layers=2, max_seq_len=2048)
    model = to_hf_model(cfg, perturbed_state(cfg), {})
    exact = {n: b.clone() for n, b in model.named_buffers() if b.is_floating_point()}
    assert any("inv_freq" in n for n in exact)
    for dtype in (torch.bfloat16, torch.float16):
        on_device(model, torch.device("cpu"), dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}
        for name, b in model.named_buffers():
            if name in exact:  # not rounded through the half type and back: the same values
                assert b.dtype == torch.float32 and torch.equal(b, exact[name]), name
        on_device(model, torch.device("cpu"), torch.float32)
