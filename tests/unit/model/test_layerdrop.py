"""Layer dropout in one process: pure schedule and decisions, the model's gates, skipped blocks doing no work, the
ZeRO-3 settings of layer mode, rho scaling, folding and pruning, and what a run shows of it. Rank consistency on real
workers and the end-to-end run are in ``tests/integration/growth/test_layer_drop.py``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pretrain.config import ConfigError, LayerDropConfig, load_config
from pretrain.model import build_model
from pretrain.model.layerdrop import (
    base_rate,
    inference_scales,
    keep_decisions,
    layer_rates,
    select_blocks,
    training_gates,
)
from tests.harness import tiny_config

STEPS, GLOBAL = 6, 8
Z3 = ["zero.stage=3", "zero.param_persistence_threshold=0"]  # every parameter partitioned, even at this size


def _cfg(*extra: str):
    """The tiny model 6 blocks deep, half of them dropped (rate 0.5), 6 steps of a global batch of 8."""
    return tiny_config(
        "model.num_layers=6",
        "model.dropout=0.0",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "data.num_streams=2",
        "train.lr=1e-2",
        "train.warmup_steps=1",
        f"train.max_steps={STEPS}",
        "train.precision=fp32",
        "train.seed=3",
        "layer_drop.rate=0.5",
        *extra,
    )


# -- pure functions ---------------------------------------------------------------------------------------


def test_schedules_and_depth_profile():
    ld = LayerDropConfig(rate=0.4)
    assert base_rate(ld, 0) == base_rate(ld, 1000) == 0.4
    lin = dataclasses.replace(ld, schedule="linear", warmup_steps=10)
    assert [base_rate(lin, s) for s in (0, 5, 10, 50)] == [0.0, 0.2, 0.4, 0.4]
    pld = dataclasses.replace(ld, schedule="progressive", gamma=0.01)
    for t in (0, 10, 100, 10_000):  # PLD: keep theta(t) = (1 - theta_bar) exp(-gamma t) + theta_bar
        theta = (1 - 0.6) * math.exp(-0.01 * t) + 0.6
        assert base_rate(pld, t) == pytest.approx(1 - theta)
    assert base_rate(pld, 0) == 0.0 and base_rate(pld, 10_000) == pytest.approx(0.4)
    assert layer_rates(dataclasses.replace(ld, by_depth="linear"), 4, 0.4) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert inference_scales(ld, 2) is None
    assert inference_scales(dataclasses.replace(ld, scaling="rho"), 2) == [(0.6, 0.6), (0.6, 0.6)]


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="^layer_drop.rate: must be in"):
        load_config(None, ["layer_drop.rate=1.0"])
    with pytest.raises(ConfigError, match="^layer_drop.warmup_steps: schedule linear"):
        load_config(None, ["layer_drop.rate=0.2", "layer_drop.schedule=linear"])
    with pytest.raises(ConfigError, match="layer_drop.mode"):
        load_config(None, ["layer_drop.mode=rows"])


def test_decisions_are_a_pure_function_of_seed_step_layer():
    ld = LayerDropConfig(rate=0.5, granularity="sublayer")
    a = [keep_decisions(ld, 3, s, 12) for s in range(50)]
    assert a == [keep_decisions(ld, 3, s, 12) for s in range(50)]
    assert a != [keep_decisions(ld, 4, s, 12) for s in range(50)], "the seed matters"
    flat = [x for step in a for block in step for x in block]
    assert 0.4 < sum(flat) / len(flat) < 0.6, "rate 0.5 keeps about half"
    assert any(at != ff for step in a for at, ff in step), "sub-layers are decided separately"
    block = [keep_decisions(dataclasses.replace(ld, granularity="block"), 3, s, 12) for s in range(50)]
    assert all(at == ff for step in block for at, ff in step)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    keep_decisions(ld, 3, 7, 12)
    training_gates(dataclasses.replace(ld, mode="sample"), 3, 7, 12, micro_id=5, batch_size=4)
    assert torch.equal(torch.rand(1), before), "decisions never touch the global RNG"


def test_sample_mode_gates_are_per_sample_and_inverted():
    ld = LayerDropConfig(rate=0.5, mode="sample")
    gates = training_gates(ld, 3, 2, 4, micro_id=1, batch_size=64)
    attn, ffn = gates[0]
    assert attn.shape == (64,) and torch.equal(attn, ffn), "block granularity: one decision per sample"
    assert set(attn.tolist()) == {0.0, 2.0}, "kept branches scaled by 1/rho"
    assert not torch.equal(attn, training_gates(ld, 3, 2, 4, micro_id=2, batch_size=64)[0][0])
    rho = training_gates(dataclasses.replace(ld, scaling="rho"), 3, 2, 4, micro_id=1, batch_size=64)
    assert set(rho[0][0].tolist()) == {0.0, 1.0} and torch.equal(rho[0][0] * 2, attn)
    # The gates come from a CPU generator; the block's activations may be on a GPU: gated there (on the meta device
    # here, which like CUDA refuses a CPU operand), not a device mismatch at the first forward.
    from pretrain.model.layers import _gated

    y = _gated(torch.ones(64, 8, 16, device="meta", dtype=torch.bfloat16), attn)
    assert y.device.type == "meta" and y.shape == (64, 8, 16) and y.dtype == torch.bfloat16


def test_select_blocks():
    assert select_blocks("every_other", 8) == [0, 2, 4, 6]
    assert select_blocks("first:3", 8) == [0, 1, 2]
    assert select_blocks("[1, 5,7]", 8) == [1, 5, 7]
    with pytest.raises(ValueError, match="blocks 0..7"):
        select_blocks([8], 8)


# -- the model's gates ------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm"])
def test_gates_skip_scale_and_do_no_work(placement):
    cfg = _cfg(f"model.norm_placement={placement}").model
    model = build_model(cfg, 0).train()
    ids = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(0))
    calls = []
    model.blocks[2].register_forward_pre_hook(lambda *_: calls.append(2))
    off = [(None, None)] * 6
    off[2] = (0.0, 0.0)
    out = model(ids, labels=ids, gates=off)
    assert calls == [], "a dropped block is not called"
    mask = [True] * 6
    mask[2] = False
    assert torch.equal(out.logits, model(ids, labels=ids, layer_mask=mask).logits)
    out.loss.backward()
    assert all(p.grad is None for p in model.blocks[2].parameters()), "and gets no backward work"
    assert all(p.grad is not None for p in model.blocks[1].parameters())
    ones = [(1.0, 1.0)] * 6  # scaling by exactly 1 is the plain model
    assert torch.equal(model(ids, gates=ones).logits, model(ids).logits)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm"])
def test_skipped_parameters_are_exactly_those_without_a_gradient(placement):
    """What ``after_backward`` zeroes under ZeRO-3: every parameter a skip leaves without a gradient, and only those
    (a skipped block's norms too for post-norm and DeepNorm; a skipped post-norm sub-layer still applies its norm)."""
    cfg = _cfg(f"model.norm_placement={placement}", "model.bias=true", "model.norm=layernorm").model
    model = build_model(cfg, 0).train()
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(0))
    block = model.blocks[3]
    names = {id(p): name for name, p in block.named_parameters()}
    for gates in ((0.0, 0.0), (0.0, None), (None, 0.0), (None, None)):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, gates=[gates if i == 3 else (None, None) for i in range(6)]).loss.backward()
        no_grad = {name for name, p in block.named_parameters() if p.grad is None}
        assert {names[id(p)] for p in block.skipped_parameters(*gates)} == no_grad, gates
        if gates == (0.0, 0.0):
            assert no_grad == set(names.values())


@pytest.mark.parametrize("placement", ["post", "deepnorm"])
def test_post_norm_dropped_sublayer_keeps_its_norm_dropped_block_skips_both(placement):
    """The rule documented next to eq. 95 in docs/growth.md: a dropped post-norm (or DeepNorm) sub-layer leaves
    LN(alpha x), a dropped block leaves x. Training, the rho-scaled eval forward and ``prune`` all follow it."""
    cfg = _cfg(f"model.norm_placement={placement}", "layer_drop.granularity=sublayer").model
    block = build_model(cfg, 0).blocks[0].eval()
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = block.norm1(block.alpha * x)
        want = block.norm2(block.alpha * h + block.ffn(h))
        torch.testing.assert_close(block(x, None, 0.0, None), want, rtol=0, atol=0)
        h = block.norm1(block.alpha * x + 0.5 * block.attn(x, None))
        torch.testing.assert_close(block(x, None, 0.5, 0.0), block.norm2(block.alpha * h), rtol=0, atol=0)
    model = build_model(cfg, 0).eval()
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = [i != 2 for i in range(6)]
    skipped = [(None, None) if i != 2 else (0.0, 0.0) for i in range(6)]
    assert torch.equal(model(ids, gates=skipped).logits, model(ids, layer_mask=mask).logits), "a block: identity"


def test_validation_of_a_scheduled_rho_run_uses_the_current_keep_probability():
    """``rho`` scaling under a ``linear`` / ``progressive`` schedule: validation during training scales each branch by
    the keep probability 1 - r(t) of the step just trained, the last step's validation (and a run stopped early, at
    its end) too: the scales ``eval`` of the checkpoint, export, prune and growth use (``as_of`` its step), which
    for a schedule that has not reached its rate are not the final rate's."""
    from pretrain.model.layerdrop import as_of
    from pretrain.train.callbacks.layer_drop import LayerDropCallback

    for schedule in (
        ["layer_drop.schedule=linear", "layer_drop.warmup_steps=4"],
        ["layer_drop.schedule=progressive", "layer_drop.gamma=0.5"],
    ):
        cfg = _cfg("layer_drop.scaling=rho", "layer_drop.by_depth=linear", *schedule)
        ld = cfg.layer_drop
        model = build_model(cfg.model, 0)
        model.branch_scales = inference_scales(ld, 6)  # what build_module sets: the final rho
        trainer = _Trainer(cfg)
        trainer.module.model, trainer.cfg = model, cfg
        cb = LayerDropCallback(cfg, 0, [0])
        ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(4))
        for step in range(1, STEPS + 1):
            cb.on_step_start(trainer, step)
            trainer.state.step = step
            cb.on_step_end(trainer, None)
            keep = [1.0 - r for r in layer_rates(ld, 6, base_rate(ld, step - 1))]
            scales = model.branch_scales or [(1.0, 1.0)] * 6  # (None: a rate of 0 so far, nothing to scale)
            assert [s for pair in scales for s in pair] == pytest.approx([k for k in keep for _ in "af"])
            if step == 2:
                assert keep[-1] > 1.0 - ld.rate + 0.05, "the schedule has not reached the final rate"
                with torch.no_grad():
                    torch.testing.assert_close(
                        model.eval()(ids).logits, model(ids, gates=[(k, k) for k in keep]).logits, rtol=0, atol=0
                    )
            assert model.branch_scales == inference_scales(as_of(ld, step - 1), 6)  # a checkpoint of this step's
        if schedule[0].endswith("progressive"):  # still below its rate at the end: not the final rate's scales
            assert model.branch_scales != inference_scales(ld, 6)
        cb.on_step_start(trainer, 3)
        trainer.state.step = 3
        cb.on_run_end(trainer, {})  # stopped early at step 3: its final validation is its checkpoint's
        assert model.branch_scales == inference_scales(as_of(ld, 2), 6) != inference_scales(ld, 6)


def test_rho_scaling_applies_at_inference_only():
    model = build_model(_cfg().model, 0)
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = model.eval()(ids).logits
    model.branch_scales = [(0.5, 0.5)] * 6
    scaled = model.eval()(ids).logits
    assert not torch.allclose(plain, scaled)
    assert torch.equal(scaled, model(ids, gates=[(0.5, 0.5)] * 6).logits)
    assert torch.equal(model.train()(ids).logits, plain), "training forwards are not rescaled"


# -- ZeRO-3, rho at inference, pruning ------------------------------------------------------------------


def test_zero3_layer_mode_turns_prefetch_off():
    """DeepSpeed's trace-based prefetch would gather skipped blocks: layer mode under ZeRO-3 turns it off (the
    2-worker test in tests/integration/growth/test_layer_drop.py checks that no skipped block is gathered)."""
    from pretrain.config import make_plan
    from pretrain.train.engine import deepspeed_config

    def zero(*extra):
        cfg = _cfg("cluster.num_workers=2", *extra)
        return deepspeed_config(cfg, make_plan(cfg, 2), "fp32")["zero_optimization"]

    assert zero(*Z3)["stage3_prefetch_bucket_size"] == 0
    assert zero(*Z3)["stage3_param_persistence_threshold"] == 0
    assert "stage3_prefetch_bucket_size" not in zero(*Z3, "layer_drop.mode=sample")
    assert "stage3_prefetch_bucket_size" not in zero(*Z3, "layer_drop.rate=0")
    assert zero("zero.stage=3")["stage3_param_persistence_threshold"] == 100_000  # DeepSpeed's default


@pytest.mark.parametrize(
    "placement, extra",
    [
        ("pre", []),
        ("post", ["model.bias=true", "model.norm=layernorm"]),
        ("sandwich", []),
        ("deepnorm", []),
        ("pre", ["moe.num_experts=4", "model.activation=swiglu"]),
    ],
)
def test_rho_folded_into_weights_equals_scaled_model(placement, extra):
    """Eq. 95 at inference: folding rho into the sub-layers' last maps gives the same function as scaling."""
    from pretrain.model.layerdrop import fold_branch_scales

    cfg = _cfg(f"model.norm_placement={placement}", "layer_drop.scaling=rho", "layer_drop.by_depth=linear", *extra)
    model = build_model(cfg.model, 0, cfg.moe).eval()
    scales = inference_scales(cfg.layer_drop, 6)
    assert scales[0] != scales[-1]
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(2))
    model.branch_scales = scales
    want = model(ids).logits
    folded = build_model(cfg.model, 1, cfg.moe).eval()
    folded.load_state_dict(fold_branch_scales(model.state_dict(), placement, scales))
    assert folded.branch_scales is None
    torch.testing.assert_close(folded(ids).logits, want, rtol=1e-5, atol=1e-5)
    model.branch_scales = None
    assert not torch.allclose(model(ids).logits, want, atol=1e-3), "the scales matter"


@pytest.mark.parametrize(
    "placement, extra",
    [
        ("pre", []),
        ("post", ["model.bias=true", "model.norm=layernorm"]),
        ("sandwich", []),
        ("deepnorm", []),  # alpha of the parent's depth (model.deepnorm_depth), not of the child's
        ("pre", ["moe.num_experts=4", "model.activation=swiglu"]),
    ],
)
def test_prune_keeps_the_parents_rho_of_the_kept_blocks(placement, extra):
    """``prune`` of a ``rho`` model with ``by_depth: linear``: the pruned model is the parent evaluated with the other
    blocks skipped and each kept block scaled by its rho *in the parent* (8 blocks, rate 0.5, every_other: 0.9375,
    0.8125, 0.6875, 0.5625), not by rho recomputed for the child's depth (0.875, 0.75, 0.625, 0.5)."""
    from pretrain.driver.prune import prune_blocks

    cfg = _cfg(
        "model.num_layers=8",
        f"model.norm_placement={placement}",
        "layer_drop.scaling=rho",
        "layer_drop.by_depth=linear",
        *extra,
    )
    parent = build_model(cfg.model, 0, cfg.moe)
    with torch.no_grad():  # norm weights and biases away from 1 and 0, so folding them matters too
        g = torch.Generator().manual_seed(5)
        for p in parent.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    parent.eval()
    keep = select_blocks("every_other", 8)
    child_cfg, sd = prune_blocks(cfg, parent.state_dict(), keep)
    assert child_cfg.model.num_layers == 4 and child_cfg.layer_drop.scaling == "inverted"
    assert (child_cfg.layer_drop.rate, child_cfg.layer_drop.by_depth) == (0.5, "linear"), "a resumed child drops on"
    assert inference_scales(child_cfg.layer_drop, 4) is None, "nothing left to apply at inference"
    child = build_model(child_cfg.model, 1, child_cfg.moe)
    child.load_state_dict(sd)
    child.eval()

    rho = inference_scales(cfg.layer_drop, 8)
    assert [rho[i] for i in keep] == [(0.9375, 0.9375), (0.8125, 0.8125), (0.6875, 0.6875), (0.5625, 0.5625)]
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    masked = [rho[i] if i in keep else (0.0, 0.0) for i in range(8)]
    want = parent(ids, gates=masked).logits
    with torch.no_grad():
        got = child(ids).logits
    # rho folded into the child's weights rounds apart from rho applied to the parent's block outputs: on an
    # AVX-512 machine up to 1.3e-6 on a logit near 0 (MoE); the child depth's rho is off by more than 1e-3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    stale = [(0.875, 0.875), (0.75, 0.75), (0.625, 0.625), (0.5, 0.5)]  # rho of the child's depth
    assert stale == inference_scales(cfg.layer_drop, 4)
    wrong = parent(ids, gates=[stale[keep.index(i)] if i in keep else (0.0, 0.0) for i in range(8)]).logits
    print(
        f"pruned vs parent with blocks skipped: max |diff| {(got - want).abs().max():.1e}; "
        f"with the child depth's rho instead: {(wrong - want).abs().max():.1e}"
    )
    assert not torch.allclose(wrong, want, atol=1e-3), "the scales matter"


def test_prune_of_an_inverted_model_keeps_weights_and_config():
    from pretrain.driver.prune import prune_blocks

    cfg = _cfg("layer_drop.by_depth=linear")
    sd = build_model(cfg.model, 0).state_dict()
    child_cfg, out = prune_blocks(cfg, sd, [1, 4])
    assert child_cfg.layer_drop == cfg.layer_drop and child_cfg.model.num_layers == 2
    assert set(out) == {
        k.replace("blocks.1.", "blocks.0.").replace("blocks.4.", "blocks.1.")
        for k in sd
        if not k.startswith("blocks.") or k.startswith(("blocks.1.", "blocks.4."))
    }
    assert all(
        torch.equal(out[k], sd[k.replace("blocks.1.", "blocks.4.").replace("blocks.0.", "blocks.1.")])
        for k in out
        if k.startswith("blocks.")
    )


# -- observability: health metrics of executed blocks only, the progress line --------------------------------


class _Trainer:
    """What ``LayerDropCallback.on_step_start`` and ``HealthCallback.on_step_end`` use of the trainer."""

    def __init__(self, cfg, step: int = 0) -> None:
        from types import SimpleNamespace

        from pretrain.train.callbacks.base import Shared

        self.shared, self.state, self.logged = Shared(), SimpleNamespace(step=step), []
        self.module = SimpleNamespace(cfg=cfg)
        self.tracker = SimpleNamespace(log_metrics=lambda metrics, step: self.logged.append((metrics, step)))


def test_health_metrics_are_logged_for_executed_blocks_only():
    """Layer dropout publishes the skipped blocks on the trainer's blackboard; health reads them there."""
    from pretrain.train.callbacks.health import HealthCallback
    from pretrain.train.callbacks.layer_drop import LayerDropCallback

    cfg = _cfg()
    layer_drop = LayerDropCallback(cfg, 0, [0])
    trainer = _Trainer(cfg)
    step = next(
        s for s in range(1, 50) if (layer_drop.on_step_start(trainer, s) or True) and layer_drop.skipped_blocks()
    )
    skipped = layer_drop.skipped_blocks()
    assert skipped and len(skipped) < 6 and trainer.shared.skipped_blocks == skipped
    health = HealthCallback(every=1)
    health.health = {f"{name}/block{i:02d}": 1.0 for i in range(6) for name in ("grad_norm", "act_rms")}
    health.health["grad_norm/embed"] = 2.0
    trainer.state.step = step
    health.on_step_end(trainer, None)
    ((metrics, at),) = trainer.logged
    assert at == step and metrics["grad_norm/embed"] == 2.0
    assert {k for k in metrics if "/block" in k} == {
        f"{name}/block{i:02d}" for i in range(6) if i not in skipped for name in ("grad_norm", "act_rms")
    }
    alone = _Trainer(cfg, step)  # no layer dropout: every block's metrics
    health.on_step_end(alone, None)
    assert sum("/block" in k for k in alone.logged[0][0]) == 12


def test_progress_line_shows_active_layers(capsys):
    from pretrain.train.progress import Progress

    progress = Progress(max_steps=10, start_step=0, tokens_per_step=100, enabled=True)
    metrics = {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/tokens_per_s": 1000.0}
    progress.line(3, {**metrics, "train/active_layers": 4.5})
    progress.line(4, metrics)
    with_layers, without = capsys.readouterr().out.splitlines()
    assert "| layers 4.50 |" in with_layers and "layers" not in without


@pytest.mark.parametrize("scaling", ["inverted", "rho"])
def test_prune_scale_train_is_the_training_forward_with_the_other_blocks_dropped(scaling):
    """``prune scale=train``: the pruned model is the parent's *training* forward of a step in which exactly the
    kept blocks ran (``inverted``: kept branches x 1/rho of their rates, here 1/(1 - 0.5 (l + 1) / 8); ``rho``:
    unscaled), not the inference forward with blocks skipped (``scale=inference``, the default)."""
    from pretrain.driver.prune import prune_blocks

    cfg = _cfg("model.num_layers=8", f"layer_drop.scaling={scaling}", "layer_drop.by_depth=linear")
    parent = build_model(cfg.model, 0, cfg.moe)
    parent.eval()
    keep = select_blocks("every_other", 8)
    child_cfg, sd = prune_blocks(cfg, parent.state_dict(), keep, scale="train")
    assert child_cfg.layer_drop.scaling == "inverted" and inference_scales(child_cfg.layer_drop, 4) is None
    child = build_model(child_cfg.model, 1, child_cfg.moe)
    child.load_state_dict(sd)
    child.eval()
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    kept = [1.0 / (1 - 0.5 * (i + 1) / 8) if scaling == "inverted" else 1.0 for i in range(8)]
    gates = [(kept[i], kept[i]) if i in keep else (0.0, 0.0) for i in range(8)]
    with torch.no_grad():
        want, got = parent(ids, gates=gates).logits, child(ids).logits
        default = prune_blocks(cfg, parent.state_dict(), keep)[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not all(torch.equal(default[k], sd[k]) for k in sd), "the default (inference) scale differs"
