"""AdamW moments put into a fresh engine (``pretrain/train/optimizer_state.py``) on one real gloo rank (the session's
process of ``tests/harness.py``). The round trip of the moments on every ZeRO stage over 2 workers is in
``tests/integration/train/test_lifecycle.py``."""

from __future__ import annotations

import torch

from tests.harness import run_distributed, tiny_config


def _load_into_fresh_engine(rank: int, world: int) -> dict:
    """A step of an MoE with loss-free balancing, then a rebuild on its weights (a fresh optimizer) and its moments
    loaded: the selection biases and routing statistics around :func:`load_moments`."""
    from pretrain.model.moe import moe_layers
    from pretrain.train.module import build_module
    from pretrain.train.optimizer_state import gather_moments, load_moments
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    cfg = tiny_config(
        "model.dropout=0.0",
        "moe.num_experts=4",
        "moe.top_k=2",
        "moe.balance=bias",
        "moe.ffn_size=48",
        "train.global_batch_size=2",
        "data.num_streams=1",
    )
    module = build_module(cfg)
    ids = torch.randint(0, 101, (module.plan.share(rank), 16), generator=torch.Generator().manual_seed(0))
    run_step(module, StepInput(1, {"input_ids": ids, "labels": ids}, 1e-3))
    full, moments = module.full_state_dict(), gather_moments(module)
    module.rebuild(cfg, weights=full)
    layers = [layer for _, layer in moe_layers(module.model)]
    for i, layer in enumerate(layers):  # statistics of forwards not yet taken
        layer.stats = torch.full((4 + 7,), float(i + 1))

    def biases() -> list[torch.Tensor]:
        return [b.clone() for layer in layers if (b := layer.selection_bias) is not None]

    before = biases()
    load_moments(module, moments)
    return {
        "loaded": bool(moments["step"]) and bool(module.engine.optimizer.state),
        "moved": [float(b.abs().max()) for b in before],
        "biases": [torch.equal(b, after) for b, after in zip(before, biases())],
        "stats": [
            layer.stats is not None and torch.equal(layer.stats, torch.full((11,), float(i + 1)))
            for i, layer in enumerate(layers)
        ],
    }


def test_loading_moments_into_a_fresh_optimizer_keeps_the_moe_selection_biases_and_statistics():
    """A fresh optimizer gets its state from one step at LR 0: that step moves no selection bias (the bias update
    is not scaled by the LR) and neither adds its routing counts to the statistics nor takes theirs."""
    (got,) = run_distributed(_load_into_fresh_engine, 1, fresh=False)
    assert got["loaded"] and min(got["moved"]) > 0, got  # the first step moved the biases away from 0
    assert got["biases"] == [True, True] and got["stats"] == [True, True], got


def _bf16_stage0_round_trip(rank: int, world: int) -> dict:
    """ZeRO-0 under bf16: DeepSpeed's unfused wrapper keeps AdamW's state on fp32 copies of the parameters. The
    moments gathered after a step, loaded into a fresh engine, and gathered again."""
    from pretrain.train.module import build_module
    from pretrain.train.optimizer_state import gather_moments, load_moments
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    cfg = tiny_config("zero.stage=0", "train.precision=bf16", "train.global_batch_size=2", "data.num_streams=1")
    module = build_module(cfg)
    ids = torch.randint(0, 101, (module.plan.share(rank), 16), generator=torch.Generator().manual_seed(0))
    run_step(module, StepInput(1, {"input_ids": ids, "labels": ids}, 1e-3))
    moments = gather_moments(module)
    module.rebuild(cfg, weights=module.full_state_dict())
    load_moments(module, moments)
    again = gather_moments(module)
    module.rebuild(cfg, optimizer_state=module.optimizer_state())  # the wrapper's own state dict, whole
    whole = gather_moments(module)
    return {
        "whole": all(torch.equal(moments[k][n], whole[k][n]) for k in ("exp_avg", "exp_avg_sq") for n in moments[k]),
        "wrapper": type(module.engine.optimizer).__name__,
        "moved": max(float(v.abs().max()) for v in moments["exp_avg"].values()),
        "same": all(torch.equal(moments[k][n], again[k][n]) for k in ("exp_avg", "exp_avg_sq") for n in moments[k]),
        "step": (moments["step"], again["step"]),
    }


def test_moments_round_trip_under_zero_0_bf16_through_the_fp32_masters():
    (got,) = run_distributed(_bf16_stage0_round_trip, 1, fresh=False)
    assert got["wrapper"] == "FP16_UnfusedOptimizer" and got["moved"] > 0, got
    assert got["same"] and got["step"][0] == got["step"][1] > 0, got
    assert got["whole"], "rebuilt with optimizer_state: the unfused wrapper loads its own state dict"
