"""The step (``pretrain/train/step.py``) on 2 real gloo ranks (the session's processes of ``tests/harness.py``):
what the padding micro-batches of uneven shares count. The step in training runs is in the integration tests (the
trainer, growth, stability, parallelism)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed, tiny_config

UNEVEN_MOE = (
    "model.dropout=0.0",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.balance=bias",
    "moe.ffn_size=48",
    "train.global_batch_size=3",
    "data.num_streams=3",
    "cluster.num_workers=2",
)
"""An MoE on 2 workers with shares of 2 and 1 sequences: micro-batches of 1, rank 1 pads one."""


def _steps(rank: int, world: int) -> dict:
    from pretrain.model.moe import moe_layers
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    module = build_module(tiny_config(*UNEVEN_MOE))
    ids = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(0))
    part = ids[:2] if rank == 0 else ids[2:]
    result = run_step(module, StepInput(1, {"input_ids": part, "labels": part}, 1e-3))
    return {
        "plan": (module.plan.shares, module.plan.grad_accum),
        "moe": result.moe,
        "biases": [b.clone() for _, layer in moe_layers(module.model) if (b := layer.selection_bias) is not None],
    }


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    return run_distributed(_steps, 2, fresh=False)


def test_padding_micro_batches_count_in_no_routing_statistics(steps):
    """Rank 1 runs its one real micro-batch and one of padding: the step's routing statistics (which move the
    selection biases and make the ``moe/`` metrics and the collapse check) are those of the 3 real sequences."""
    r0 = steps[0]
    assert r0["plan"] == ((2, 1), 2)
    for block, row in r0["moe"].items():
        routed, forwards = row[:4], row[-1]
        assert forwards == 3 and routed.sum() == 3 * 16 * 2, (block, row)  # 3 sequences of 16 tokens, top-2
    assert all(torch.equal(a, b) for a, b in zip(r0["biases"], steps[1]["biases"]))
