"""Expert parallelism applied to a built model (``pretrain/parallel/expert.py``)."""

from __future__ import annotations

import torch

from pretrain.model import build_model
from pretrain.model.moe import moe_layers
from tests.unit.model.test_moe import _small


def test_expert_parallel_slices_equal_the_full_model():
    """Worker r of EP=2 holds exactly experts [2r, 2r+2) of the EP=1 model; everything else is identical."""
    from pretrain.config import make_plan
    from pretrain.parallel.expert import apply_expert_parallel

    full = build_model(_small().model, 5, _small().moe).state_dict()
    for rank in (0, 1):
        ep = _small("parallel.expert=2", "cluster.num_workers=2")
        model = build_model(ep.model, 5, ep.moe)  # every expert; the worker keeps its slice (as build_module does)
        assert apply_expert_parallel(model, make_plan(ep, 2).dims, rank) == len(moe_layers(model)) == 2
        part = model.state_dict()
        assert sum(".deepspeed_experts." in k for k in part) * 2 == sum(".deepspeed_experts." in k for k in full)
        for key, value in part.items():
            if ".deepspeed_experts." in key:
                head, tail = key.split(".deepspeed_experts.")
                local, rest = tail.split(".", 1)
                key = f"{head}.deepspeed_experts.{2 * rank + int(local)}.{rest}"
            assert torch.equal(full[key], value), key
