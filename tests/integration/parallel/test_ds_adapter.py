"""The MoE expert path is the training side's choice, on a real gloo rank: ZeRO-3 runs the experts module by module,
ZeRO-1 as one grouped GEMM (the adapter's rule itself is checked on the source in
``tests/unit/house/test_ds_adapter.py``)."""

from __future__ import annotations

import pytest

from tests.harness import TINY_MODEL, run_distributed

_MOE = [
    *TINY_MODEL,
    "model.dropout=0.0",
    "model.activation=swiglu",
    "data.num_streams=1",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.precision=fp32",
    "moe.num_experts=4",
    "cluster.num_workers=1",
]


def _grouped_runs(rank: int, world: int, stages: list[int]) -> dict:
    import torch

    from pretrain.config import load_config
    from pretrain.model import moe as moe_mod
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    calls: list[int] = []
    grouped = moe_mod.grouped_ffn
    moe_mod.grouped_ffn = lambda *a: calls.append(1) or grouped(*a)
    out = {}
    for stage in stages:
        module = build_module(load_config(None, _MOE + [f"zero.stage={stage}"]))
        flags = [layer.grouped_experts for _, layer in moe_mod.moe_layers(module.model)]
        calls.clear()
        ids = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(1))
        loss = run_step(module, StepInput(1, {"input_ids": ids, "labels": ids}, 1e-3)).loss
        out[stage] = (flags, len(calls), loss)
    return out


def test_partitioned_experts_run_module_by_module():
    """The training side decides the MoE expert path: ZeRO-3 (experts partitioned, also the small persistent
    ones) runs the experts as modules, ZeRO-1 as one grouped GEMM; both train the same step."""
    res = run_distributed(_grouped_runs, 1, [1, 3], fresh=False)[0]
    assert res[1][:2] == ([True, True], 2)  # one forward through 2 MoE blocks
    assert res[3][:2] == ([False, False], 0)
    assert res[3][2] == pytest.approx(res[1][2], rel=1e-5)
