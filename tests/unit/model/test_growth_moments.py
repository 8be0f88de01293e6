"""``growth.optimizer: grow``: AdamW's moments after a growth are those the grown model's own gradients give.

One-step check: one AdamW step of the parent from zero moments (m = (1 - b1) g, v = (1 - b2) g^2), the moments
grown, against one AdamW step of the grown model (weights grown without noise) on the same batch from zero moments.
For a function-preserving width growth the grown model's gradient is a fixed linear map T of the parent's, so the
grown moments must be T(m) and T^2(v) exactly (ratio 1 within 1e-5, float64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config import GrowthStep, LayerDropConfig
from pretrain.model import build_model
from pretrain.model.growth import apply_growth
from pretrain.model.growth_moments import grow_moments
from tests.unit.model.test_growth import ARCHS, _cfg, _ids

MOMENTS = ("exp_avg", "exp_avg_sq")


def _one_step_moments(
    model: torch.nn.Module, ids: torch.Tensor, scales: list[tuple[float, float]] | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """``scales``: the step taken in the model scaled as at inference (rho of ``layer_drop.scaling: rho``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model.train(scales is None)
    model.branch_scales = scales
    model(ids, labels=ids).loss.backward()
    opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    return {k: {names[id(p)]: st[k].clone() for p, st in opt.state.items()} for k in MOMENTS}


def _assert_ratio_one(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, scale: float | None = None
) -> None:
    assert set(got) == set(want), (what, set(got) ^ set(want))
    # ratio 1 within 1e-5 wherever the true moment is above rounding noise: RMSNorm and attention scores compute in
    # fp32 even in a float64 model (1e-7 of the largest moment), and a key bias, to which softmax attention is
    # invariant, has a true gradient of pure rounding noise
    scale = scale if scale is not None else max(float(w.abs().max()) for w in want.values())
    for name, w in want.items():
        g = got[name].to(w.dtype)
        tol = 1e-5 * w.abs() + 1e-7 * scale
        bad = (g - w).abs() > tol
        assert not bad.any(), (what, name, float((g[bad] / w[bad]).min()), float((g[bad] / w[bad]).max()))


CASES = {
    "gpt2-tile2": ("gpt2", GrowthStep(width="2x", noise=0)),
    "gpt2-tile3": ("gpt2", GrowthStep(width="3x", noise=0)),
    "llama-tile2": ("llama", GrowthStep(width="2x", noise=0)),
    "llama-tile3": ("llama", GrowthStep(width="3x", noise=0)),
    "bert-tile2": ("bert", GrowthStep(width="2x", noise=0)),
    "moe-tile2": ("moe", GrowthStep(width="2x", noise=0)),
    "gpt2-net2net-ffn": ("gpt2", GrowthStep(ffn="1.5x", width_op="net2net", noise=0)),
    "llama-net2net-ffn": ("llama", GrowthStep(ffn="+64", width_op="net2net", noise=0)),
}


@pytest.mark.parametrize("case", CASES)
def test_grown_moments_equal_the_grown_models_own_moments(case):
    arch, entry = CASES[case]
    cfg, moe = _cfg(*ARCHS[arch], "model.tie_embeddings=false")
    parent = build_model(cfg, 0, moe).double()
    ids, weights = _ids(), {k: v.detach().clone() for k, v in parent.state_dict().items()}  # before the step
    moments = _one_step_moments(parent, ids)
    grown = apply_growth(cfg, moe, weights, entry, seed=7)
    child = build_model(grown.model, 0, grown.moe, weights={k: v.clone() for k, v in grown.state.items()})
    want = _one_step_moments(child, ids)
    got = grow_moments(cfg, moe, moments, entry, seed=7)
    for k in MOMENTS:
        _assert_ratio_one(got[k], want[k], f"{case} {k}")


def test_depth_moments_copy_stacked_blocks_and_start_new_identity_blocks_at_zero():
    """stack / interleave are not function-preserving: no map takes the parent's gradient to the grown model's
    (the blocks sit at other depths), so a copied block takes its source block's moments unchanged (T = identity,
    T^2 = identity). identity: the trained blocks keep their moments exactly (their gradients are unchanged: every
    new block's branch outputs zero), the new blocks start from zero moments."""
    cfg, moe = _cfg(*ARCHS["gpt2"])
    parent = build_model(cfg, 0, moe).double()
    ids, weights = _ids(), {k: v.detach().clone() for k, v in parent.state_dict().items()}  # before the step
    moments = _one_step_moments(parent, ids)
    got = grow_moments(cfg, moe, moments, GrowthStep(depth="2x", depth_op="stack", noise=0), seed=0)
    for k in MOMENTS:
        for name, value in moments[k].items():
            if name.startswith("blocks."):
                i, rest = name.split(".", 2)[1:]
                assert torch.equal(got[k][f"blocks.{int(i) + 2}.{rest}"], value)
            assert torch.equal(got[k][name], value)
    entry = GrowthStep(depth="+2", depth_op="identity", noise=0)
    got = grow_moments(cfg, moe, moments, entry, seed=0)
    grown = apply_growth(cfg, moe, weights, entry, seed=0)
    want = _one_step_moments(build_model(grown.model, 0, grown.moe, weights=dict(grown.state)), ids)
    for k in MOMENTS:
        for name in want[k]:
            if name.startswith(("blocks.2.", "blocks.3.")):
                assert not got[k][name].any(), (k, name)
            else:
                scale = max(float(w.abs().max()) for w in want[k].values())
                _assert_ratio_one({name: got[k][name]}, {name: want[k][name]}, f"identity {k}", scale)


@pytest.mark.parametrize("placement", ["pre", "sandwich"])
def test_depth_moments_under_rho_scaling_follow_the_rescaled_blocks(placement):
    """``layer_drop.scaling: rho``, ``by_depth: linear``: identity depth growth 2 -> 4 multiplies a kept block's last
    linear map by a_old / a_new, so in the scaled model its gradient is times a_new / a_old. The grown moments equal
    the grown model's own (one step of the scaled model) for every kept block; left as they were they do not."""
    from pretrain.model.layerdrop import inference_scales

    cfg, moe = _cfg(*ARCHS["llama"], f"model.norm_placement={placement}")
    ld = dataclasses.replace(LayerDropConfig(), rate=0.8, scaling="rho", by_depth="linear")
    parent = build_model(cfg, 0, moe).double()
    ids, weights = _ids(), {k: v.detach().clone() for k, v in parent.state_dict().items()}
    moments = _one_step_moments(parent, ids, inference_scales(ld, 2))
    entry = GrowthStep(depth="+2", depth_op="identity", noise=0)
    grown = apply_growth(cfg, moe, weights, entry, seed=0, layer_drop=ld)
    child = build_model(grown.model, 0, grown.moe, weights=dict(grown.state))
    want = _one_step_moments(child, ids, inference_scales(ld, 4))
    got, stale = grow_moments(cfg, moe, moments, entry, 0, ld), grow_moments(cfg, moe, moments, entry, 0)
    last = "norm_out1.weight" if placement == "sandwich" else "attn.o_proj.weight"
    for k in MOMENTS:
        kept = {n: w for n, w in want[k].items() if not n.startswith(("blocks.2.", "blocks.3."))}
        _assert_ratio_one(
            {n: got[k][n] for n in kept}, kept, f"rho {k}", max(float(w.abs().max()) for w in kept.values())
        )
        assert not torch.allclose(stale[k][f"blocks.0.{last}"], want[k][f"blocks.0.{last}"], rtol=1e-3)
