"""The Mixture-of-Experts layer (``pretrain/model/moe.py``) in one process: routing semantics, grouped experts,
capacity, activation checkpointing, aux losses and metrics, loss-free balancing, an MoE encoder. Its config checks,
expert-parallel slices, layout conversion on resume, collapse flag and HF export are tested beside the modules that
own them; expert parallelism on real gloo ranks is in ``tests/integration/parallel/test_moe.py``."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.config import ConfigError, from_dict, load_config, to_dict
from pretrain.model import build_model
from pretrain.model.moe import MoEFeedForward, moe_layers, routing_metrics
from tests.conftest import ROOT
from tests.harness import TINY_MODEL, tiny_model

STEPS, GLOBAL, MICRO = 4, 8, 4
SMALL = [
    *TINY_MODEL,
    "model.dropout=0.0",
    "model.activation=swiglu",
    "data.num_streams=2",
    f"train.global_batch_size={GLOBAL}",
    f"train.micro_batch_size={MICRO}",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    f"train.max_steps={STEPS}",
    "train.precision=fp32",
    "moe.num_experts=4",
]
"""The tiny model with 4 experts in every block, 4 steps of a global batch of 8."""


def _small(*over: str):
    return load_config(None, SMALL + list(over))


# ----------------------------------------------------------------------------------------------
# Routing semantics
# ----------------------------------------------------------------------------------------------


def _naive(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Per-token reference: softmax -> top-k -> (renormalize) -> weighted sum of expert FFNs."""
    h = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        p = layer.router(h[t]).float().softmax(-1)
        w, idx = p.topk(layer.top_k)
        if layer.normalize_top_k:
            w = w / w.sum()
        for wi, e in sorted(zip(w.tolist(), idx.tolist()), key=lambda z: z[1]):
            out[t] += wi * layer.experts[e](h[t : t + 1])[0]
    return out.view_as(x)


@pytest.mark.parametrize("k,normalize", [(1, True), (2, True), (2, False), (4, True)])
def test_routing_matches_per_token_reference(k, normalize):
    cfg = _small(f"moe.top_k={k}", f"moe.normalize_top_k={str(normalize).lower()}")
    model = build_model(cfg.model, 0, cfg.moe)
    layer = moe_layers(model)[0][1]
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), _naive(layer, x), rtol=0, atol=1e-6)


def _router_lm_grad(k: int) -> float:
    """Norm of the routers' gradient from the language-model loss alone (auxiliary and z losses off)."""
    cfg = _small(f"moe.top_k={k}", "moe.aux_loss_weight=0", "moe.router_z_loss_weight=0")
    model = build_model(cfg.model, 0, cfg.moe).train()
    ids = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids).loss.backward()
    return math.sqrt(sum(float(layer.router.weight.grad.square().sum()) for _, layer in moe_layers(model)))


def test_top1_router_learns_from_the_lm_loss():
    """Top-1 with the default normalize_top_k: renormalizing one weight gives p/p = 1 and no router gradient; top-1
    uses Switch's weight (the chosen expert's probability) instead, so the router learns from the loss."""
    top1, top2 = _router_lm_grad(1), _router_lm_grad(2)
    assert top1 > 0.05 * top2 > 0, (top1, top2)


def test_the_grouped_mm_probe_is_right_under_no_grad():
    """Its first call may come from code under ``torch.no_grad()`` (growth, evaluation): the answer it caches is the
    same."""
    from pretrain.model import moe as moe_mod

    for mode in (torch.no_grad, torch.inference_mode):
        moe_mod.grouped_mm_supported.cache_clear()
        with mode():
            assert moe_mod.grouped_mm_supported(torch.device("cpu"), torch.float32), mode.__name__


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gelu", True)])
def test_grouped_experts_equal_the_expert_loop(activation, bias):
    """One grouped GEMM per projection gives the per-expert loop's outputs and gradients, empty experts included."""
    from pretrain.model import moe as moe_mod

    assert moe_mod.grouped_mm_supported(torch.device("cpu"), torch.float32)
    cfg = _small(f"model.activation={activation}", f"model.bias={str(bias).lower()}", "model.hidden_size=64")
    experts = moe_layers(build_model(cfg.model, 0, cfg.moe))[0][1].experts
    counts = torch.tensor([5, 0, 11, 3])
    x = torch.randn(int(counts.sum()), 64, generator=torch.Generator().manual_seed(2))
    r = torch.randn(int(counts.sum()), 64, generator=torch.Generator().manual_seed(3))
    results = []
    for fn in (moe_mod.loop_ffn, moe_mod.grouped_ffn):
        xi = x.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        y = fn(experts, xi, counts)
        (y * r).sum().backward()
        results.append((y.detach(), xi.grad, [p.grad.clone() for p in experts.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    assert len(gp1) == len(gp0) == len(list(experts.parameters()))  # every expert has a gradient (zeros if empty)
    for a, b in zip(gp1, gp0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(float(p.abs().sum()) == 0 for p in (experts[1].up_proj.weight.grad, experts[1].down_proj.weight.grad))


def test_grouped_experts_train_like_the_expert_loop(monkeypatch):
    """20 fp32 AdamW steps of a small MoE decoder: grouped GEMM and the expert loop give the same losses (1e-5
    relative), and the grouped path is the one that runs by default."""
    from pretrain.model import moe as moe_mod
    from pretrain.model import param_groups

    calls = {"grouped": 0}
    grouped = moe_mod.grouped_ffn

    def counting(*a):
        calls["grouped"] += 1
        return grouped(*a)

    def losses(use_grouped: bool) -> list[float]:
        monkeypatch.setattr(moe_mod, "grouped_ffn", counting)
        if not use_grouped:
            monkeypatch.setattr(moe_mod, "grouped_mm_supported", lambda device, dtype: False)
        cfg = _small("moe.top_k=2")
        torch.manual_seed(0)
        model = build_model(cfg.model, 0, cfg.moe)
        opt = torch.optim.AdamW(param_groups(model, 0.01), lr=3e-3)
        g = torch.Generator().manual_seed(5)
        out = []
        for _ in range(20):
            ids = torch.randint(0, 101, (4, 16), generator=g)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        monkeypatch.undo()
        return out

    ref = losses(False)
    assert calls["grouped"] == 0
    got = losses(True)
    assert calls["grouped"] == 20 * 2  # every forward of both MoE blocks
    assert got == pytest.approx(ref, rel=1e-5)
    assert ref[-1] < ref[0]


def test_layer_selection_and_independent_expert_init():
    cfg = load_config(None, SMALL + ["model.num_layers=6", "moe.every=2"])
    assert [i for i, _ in moe_layers(build_model(cfg.model, 0, cfg.moe))] == [1, 3, 5]
    cfg = load_config(None, SMALL + ["model.num_layers=6", "moe.layers=[0, 4]"])
    model = build_model(cfg.model, 0, cfg.moe)
    assert [i for i, _ in moe_layers(model)] == [0, 4]
    experts = moe_layers(model)[0][1].experts
    ws = [e.up_proj.weight for e in experts]
    assert all(not torch.equal(ws[0], w) for w in ws[1:]), "experts must not be copies of one expert"
    assert ws[0].std().item() == pytest.approx(cfg.model.init_std, rel=0.2)


def test_capacity_drops_in_training_only_and_first_choices_win():
    cfg = _small("moe.top_k=2", "moe.capacity_factor=0.5")
    model = build_model(cfg.model, 0, cfg.moe)
    layer = moe_layers(model)[0][1]
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2))
    layer.train()
    layer(x)
    layer.commit_stats()
    stats = layer.take_stats()
    m = routing_metrics({0: stats})
    # capacity ceil(0.5 * 16 * 2 / 4) = 4 per expert, 16 of 32 assignments at most
    assert m["moe/block0/dropped_frac"] >= 0.5 - 1e-6
    assert sum(m[f"moe/block0/expert{e}_tokens"] for e in range(4)) == 32
    layer.eval()
    dropless = _naive(layer, x)
    torch.testing.assert_close(layer(x), dropless, rtol=0, atol=1e-6)
    layer.commit_stats()
    assert layer.take_stats().sum() == 0, "evaluation forwards do not count"


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_activation_checkpointing_counts_routing_once_and_keeps_gradients(placement):
    """Also on a process's first step (the grouped-matmul probe not yet cached: it runs before the recomputed
    blocks), and an evaluation after the step counts no routing (a recomputation's row is not committed)."""
    from pretrain.model import moe as moe_mod

    cfg = _small(f"model.norm_placement={placement}")
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(4))
    grads, stats = [], []
    for recompute in ("none", "full", "selective"):
        moe_mod.grouped_mm_supported.cache_clear()
        model = build_model(cfg.model, 0, cfg.moe).train()
        model.activation_checkpointing = recompute
        model(ids, labels=ids).objective().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        stats.append([layer.take_stats() for _, layer in moe_layers(model)])
        with torch.no_grad():
            model.eval()(ids)
        assert all(layer.stats is None for _, layer in moe_layers(model)), recompute
    for g, s in zip(grads[1:], stats[1:]):
        torch.testing.assert_close(g, grads[0])
        for a, b in zip(s, stats[0]):
            torch.testing.assert_close(a, b)


def test_aux_losses_and_metrics():
    cfg = _small("moe.aux_loss_weight=0.5", "moe.router_z_loss_weight=0.25")
    model = build_model(cfg.model, 0, cfg.moe).train()
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(3))
    out = model(ids, labels=ids)
    layers = moe_layers(model)
    manual = sum(layer.aux_loss for _, layer in layers)
    torch.testing.assert_close(out.moe_loss, manual)
    torch.testing.assert_close(out.objective(), out.loss + out.moe_loss)
    m = routing_metrics({i: layer.take_stats() for i, layer in layers})
    for i, _ in layers:
        assert 0.25 <= m[f"moe/block{i}/max_share"] <= 1.0
        assert 0 < m[f"moe/block{i}/router_entropy"] <= math.log(4) + 1e-6
        assert m[f"moe/block{i}/aux_loss"] >= 1.0 - 1e-6  # Switch balance loss is minimal (1) when uniform
        assert m[f"moe/block{i}/dropped_frac"] == 0.0
    assert build_model(_small("moe.num_experts=0").model, 0, None)(ids, labels=ids).moe_loss is None


def test_loss_free_balancing_evens_a_skewed_router_without_an_aux_loss():
    """moe.balance=bias: with the router frozen and skewed towards expert 0, the selection bias alone brings the
    busiest expert's share from ~0.5 towards uniform (0.25) within 80 steps; the combine weights stay the router's
    probabilities of the chosen experts; no Switch loss enters the objective."""
    cfg = _small(
        "moe.balance=bias",
        "moe.bias_rate=0.01",
        "moe.top_k=1",
        "moe.normalize_top_k=false",
        "moe.router_z_loss_weight=0",
    )
    layer = moe_layers(build_model(cfg.model, 0, cfg.moe))[0][1].train()
    g = torch.Generator().manual_seed(0)
    u = torch.randn(32, generator=g)
    u /= u.norm()
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.3, generator=g)
        layer.router.weight[0] += 2 * u
    shares = []
    for _ in range(80):
        x = torch.randn(4, 16, 32, generator=g) + u
        layer(x)
        assert float(layer.aux_loss) == 0.0
        layer.commit_stats()
        routed = layer.take_stats()[:4]
        shares.append(float(routed.max() / routed.sum()))
        layer.update_bias(routed)
    first, last = sum(shares[:5]) / 5, sum(shares[-10:]) / 10
    print(f"\nmax expert share: first 5 steps {first:.3f}, last 10 steps {last:.3f}; bias {layer.selection_bias}")
    assert first > 0.45 and last < 0.35
    assert layer.selection_bias[0] < 0 < layer.selection_bias[1:].min()
    h = x.reshape(-1, 32)  # the last batch: chosen by probs + bias, weighted by probs alone
    probs = layer.router(h).float().softmax(-1)
    chosen = (probs + layer.selection_bias).topk(1).indices
    ref = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for e in sorted(chosen[t].tolist()):
            ref[t] += probs[t, e] * layer.experts[e](h[t : t + 1])[0]
    torch.testing.assert_close(layer(x).reshape(-1, 32), ref, rtol=0, atol=1e-6)
    assert not torch.equal(chosen, probs.topk(1).indices), "the bias changed some choices"


def test_loss_free_balancing_bias_is_saved_grown_and_bf16_safe():
    cfg = _small("moe.balance=both")
    model = build_model(cfg.model, 0, cfg.moe)
    key = "blocks.0.ffn.deepspeed_moe.gate.selection_bias"
    assert torch.equal(model.state_dict()[key], torch.zeros(4))
    assert key not in build_model(_small().model, 0, _small().moe).state_dict()  # aux_loss: checkpoints unchanged
    sd = {**model.state_dict(), key: torch.tensor([0.1, -0.2, 0.3, -0.4])}
    assert torch.equal(build_model(cfg.model, 0, cfg.moe, weights=sd).state_dict()[key], sd[key])
    legacy = {k.replace("selection_bias", "expert_bias"): v for k, v in sd.items()}  # written by older versions
    assert torch.equal(build_model(cfg.model, 0, cfg.moe, weights=legacy).state_dict()[key], sd[key])
    # DeepSpeed's MoE checkpoint takes any key of an MoE layer with "expert" in it, but the router's, for an
    # expert's weight (and fails on one that names no expert): the bias's key must not look like one
    experts = ".deepspeed_moe.experts.deepspeed_experts."
    odd = [k for k in model.state_dict() if ".ffn." in k and "expert" in k and experts not in k]
    assert odd == [], odd
    layer = moe_layers(build_model(cfg.model, 0, cfg.moe))[0][1]
    assert layer.aux_loss_weight == cfg.moe.aux_loss_weight  # both: the Switch loss stays


def test_moe_encoder_trains_on_masked_tokens():
    """The same MoE layer in a bidirectional masked LM: the objective (MLM loss + aux) goes down."""
    cfg = load_config(
        ROOT / "configs" / "demo-moe-encoder.yaml",
        [*tiny_model(ffn_size=64, dropout=0.0), "moe.ffn_size=32", "moe.every=1"],
    )
    model = build_model(cfg.model, 0, cfg.moe).train()
    assert len(moe_layers(model)) == 2 and not model.causal
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    ids = (torch.randint(0, 101, (8, 1), generator=g) + torch.arange(16)) % 101
    labels = torch.where(torch.rand(ids.shape, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    inputs = torch.where(labels != -100, torch.zeros_like(ids), ids)  # token 0 as the mask
    losses = []
    for _ in range(30):
        out = model(inputs, labels=labels)
        assert out.moe_loss is not None
        out.objective().backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss))
    assert losses[-1] < losses[0] - 1.0, losses


def test_a_block_layer_dropout_skipped_reports_no_routing_and_holds_the_collapse_streak():
    """A block skipped for a whole step (layer dropout's ``layer`` mode) routed nothing: no ``moe/`` metric of it (it
    would read as every token dropped and a balanced load of 0), and no share that would reset a collapse streak."""
    from pretrain.config import MoEConfig
    from pretrain.model.moe import STAT_FIELDS, max_shares
    from pretrain.train.stability.monitor import StabilityMonitor

    experts = 4
    ran = torch.tensor([90.0, 4, 3, 3, 100, 100, 100, 50, 1.2, 0.1, 1])  # routed per expert, STAT_FIELDS, 1 forward
    skipped = torch.zeros(experts + len(STAT_FIELDS) + 1)
    assert set(routing_metrics({0: ran, 1: skipped})) == {k for k in routing_metrics({0: ran}) if "block0" in k}
    assert max_shares({0: ran, 1: skipped}) == {0: 0.9}
    monitor = StabilityMonitor(load_config(None, []).stability, moe=MoEConfig(collapse_share=0.8, collapse_steps=3))
    flagged = [monitor.router_collapse(step, max_shares({0: row})) for step, row in enumerate((ran, skipped, ran, ran))]
    assert [len(events) for events in flagged] == [0, 0, 0, 1], "the skipped step neither counts nor resets"


def test_a_top2_router_that_collapsed_is_flagged_with_the_default_share():
    """Every token's two choices are experts 0 and 1 of 8: each takes every token (share 1.0, the metric and the
    alarm alike), which the default ``moe.collapse_share`` (0.9) flags; a share of the routed assignments (here 0.5)
    never could reach it at top-2."""
    from pretrain.config import MoEConfig
    from pretrain.model.moe import max_shares
    from pretrain.train.stability.monitor import StabilityMonitor

    config = load_config(None, [*TINY_MODEL, "moe.num_experts=8", "moe.top_k=2"])
    layer = moe_layers(build_model(config.model, 0, config.moe))[0][1]
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:2] = 1.0
    layer.train()(torch.ones(2, 8, config.model.hidden_size))
    layer.commit_stats()
    row = layer.take_stats()
    assert row[:8].tolist() == [16.0, 16.0, 0, 0, 0, 0, 0, 0]
    assert max_shares({0: row}) == {0: 1.0} and routing_metrics({0: row})["moe/block0/max_share"] == 1.0
    monitor = StabilityMonitor(config.stability, moe=MoEConfig(num_experts=8, top_k=2, collapse_steps=2))
    assert [len(monitor.router_collapse(step, max_shares({0: row}))) for step in (1, 2)] == [0, 1]
    with pytest.raises(ConfigError, match=r"^moe.collapse_share: 0.25 is not above a balanced router's share"):
        load_config(None, ["moe.num_experts=8", "moe.top_k=2", "moe.collapse_share=0.25"])
    stored = to_dict(config)  # a checkpoint's config an older version took (the share was of the assignments)
    stored["moe"]["collapse_share"] = 0.25
    assert from_dict(stored).moe.collapse_share == 0.25  # still resumed, exported, evaluated
    fixed = load_config(None, ["moe.collapse_share=0.9"], base=stored)  # and an override mends it
    assert fixed.moe.collapse_share == 0.9
    every = StabilityMonitor(config.stability, moe=MoEConfig(num_experts=2, top_k=2, collapse_steps=1))
    assert every.router_collapse(1, {0: 1.0}) == [], "top_k == num_experts: no choice, no collapse"
