"""AdamW's moments of a grown model (``growth.optimizer: grow``): transformed like the *gradients*, not the weights.

Width growth (``tile``, ``net2net``) and upcycling map the weights by copying entries and scaling them:
w'_a = c_a * w_s(a) (a linear map A). When the grown function equals the parent's and the copies of an entry are
symmetric (they see the same inputs and errors), the grown model's gradient is g'_a = c_a / D_s(a) * g_s(a) with
D_s = sum of c_b^2 over the copies b of entry s: the one gradient with A^T g' = g (the chain rule through w' = A w)
that treats the copies alike, g' = A (A^T A)^-1 g. So with T that map, the moments are m' = T(m), v' = T^2(v)
(each entry's coefficient squared). For ``tile`` by k this gives:

    internal matrices (both sides grown, W / k):  c = 1/k, k^2 copies: g / k    (like the weight)
    embeddings, norms, biases (copied, c = 1):    k copies:            g / k    (the weight is not divided)
    LM head, MoE router (input side, W / k):      k copies of c = 1/k: g        (the weight is divided)

``net2net`` (a unit copied n times, its consumers' columns divided by n) follows from the same formula.
Upcycling gives each expert 1/E of the dense FFN's moments (the mean share of the gradient under uniform routing) and
the new router zero moments. Tied embeddings untied by width growth: the parent's moment is that of the sum of the
two uses' gradients, which cannot be split exactly; the same formula splits it (an approximation).

Depth growth is not a symmetric copy: ``stack`` / ``interleave`` put copies at other depths (a new function: no map
of the parent's gradient gives the grown model's), so a copied block takes its source block's moments unchanged;
``identity`` keeps the trained blocks' moments exactly (a zero residual branch leaves their gradients unchanged) and
starts every new block from zero moments. Under ``layer_drop.scaling: rho`` with depth-dependent rates, a depth
growth rescales each block's last linear map to keep its inference scale (``apply_growth``); its moments are
rescaled like its gradient in the scaled model (m by the inverse factor, v by its square).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pretrain.config import LayerDropConfig, ModelConfig, MoEConfig
from pretrain.model.growth import _BLOCK, StateDict, apply_growth, grow_depth, resolve_count
from pretrain.model.layerdrop import fold_branch_scales, inference_scales

MOMENTS = ("exp_avg", "exp_avg_sq")


def grow_moments(
    cfg: ModelConfig,
    moe: MoEConfig,
    moments: dict[str, Any],
    entry,
    seed: int,
    layer_drop: LayerDropConfig | None = None,
) -> dict[str, StateDict]:
    """``{"exp_avg": m, "exp_avg_sq": v}`` (full tensors by parameter name) of a model ``cfg`` -> those of the model
    that ``apply_growth(cfg, moe, weights, entry, seed, layer_drop)`` grows (the same operators, seed, target and
    layer dropout).

    A depth growth under ``rho`` scaling that changes the blocks' inference scales multiplies a kept block's last
    linear map by a_old / a_new (``apply_growth``); its gradient in the scaled model is then times a_new / a_old, so
    m is scaled by that and v by its square (Adam's first step after the growth is what it would have been)."""
    m, v = moments["exp_avg"], moments["exp_avg_sq"]
    if entry.depth:
        target = resolve_count(entry.depth, cfg.num_layers)
        old = inference_scales(layer_drop, cfg.num_layers) if layer_drop is not None else None
        new = inference_scales(layer_drop, target) if layer_drop is not None else None
        rescale = bool(old and new and len(set(old + new)) > 1)
        if rescale:  # the gradient in apply_growth's folded space: divided by the parent's scales
            assert old is not None
            m, v = _fold(m, v, cfg.norm_placement, [(1.0 / a, 1.0 / f) for a, f in old])
        new_cfg, new_moe, m = _grow_depth(cfg, moe, m, target, entry.depth_op)
        _, _, v = _grow_depth(cfg, moe, v, target, entry.depth_op)
        if rescale:  # and out of it: times the child's
            assert new is not None
            m, v = _fold(m, v, cfg.norm_placement, new)
        cfg, moe = new_cfg, new_moe
    rest = dataclasses.replace(entry, depth="", noise=0.0)
    if rest.width or rest.heads or rest.ffn or rest.experts:
        coef, src = _copy_map(lambda sd: apply_growth(cfg, moe, sd, rest, seed).state, m)
        m, v = _apply(coef, src, m, 1), _apply(coef, src, v, 2)
    return {"exp_avg": m, "exp_avg_sq": v}


def _fold(m: StateDict, v: StateDict, placement: str, scales: list[tuple[float, float]]) -> tuple[StateDict, StateDict]:
    """The moments of weights whose blocks' last linear maps were multiplied by 1 / ``scales`` (m times the scale, v
    times its square)."""
    return fold_branch_scales(m, placement, scales), fold_branch_scales(
        v, placement, [(a * a, f * f) for a, f in scales]
    )


def _grow_depth(
    cfg: ModelConfig, moe: MoEConfig, state: StateDict, target: int, op: str
) -> tuple[ModelConfig, MoEConfig, StateDict]:
    n = cfg.num_layers
    new_cfg, new_moe, out = grow_depth(cfg, moe, state, target, op)
    if op == "identity":  # new blocks: zero moments throughout (grow_depth zeroes only their branch outputs)
        for key, value in out.items():
            block = _BLOCK.match(key)
            if block and int(block.group(1)) >= n:
                out[key] = torch.zeros_like(value)
    return new_cfg, new_moe, out


def _copy_map(grow, state: StateDict) -> tuple[StateDict, dict[str, torch.Tensor]]:
    """The copy-and-scale map ``grow`` applies: per grown tensor, the coefficient c_a of each entry and the global
    index s(a) of the parent entry it copies (-1 where it copies none, c = 0). Found by growing all-ones tensors (c)
    and each entry's 1-based global index (c * (s + 1)) in float64, exact for any model below 2^50 entries. Global
    indices follow the order of ``state``'s keys."""
    ones, ids, offset = {}, {}, 0
    for key, value in state.items():
        ones[key] = torch.ones(value.shape, dtype=torch.float64)
        ids[key] = torch.arange(offset + 1, offset + value.numel() + 1, dtype=torch.float64).view(value.shape)
        offset += value.numel()
    coef, tagged = grow(ones), grow(ids)
    src = {
        k: torch.where(c != 0, (tagged[k] / torch.where(c != 0, c, 1.0)).round() - 1, -1.0).long()
        for k, c in coef.items()
    }
    return {k: c.double() for k, c in coef.items()}, src


def _apply(coef: StateDict, src: dict[str, torch.Tensor], state: StateDict, power: int) -> StateDict:
    """(c_a / D_s(a))^power * state_s(a) for every grown entry a (0 where it copies nothing); ``state`` has the keys
    (in the order) :func:`_copy_map` was given."""
    flat = torch.cat([v.detach().reshape(-1).double() for v in state.values()])
    denom = torch.zeros(flat.numel(), dtype=torch.float64)
    for k, c in coef.items():
        hit = src[k] >= 0
        denom.index_add_(0, src[k][hit], c[hit] ** 2)
    out: StateDict = {}
    dtype = next(iter(state.values())).dtype
    for k, c in coef.items():
        hit = src[k] >= 0
        s = src[k].clamp_min(0)
        factor = torch.where(hit, c / denom[s].clamp_min(1e-300), 0.0)
        out[k] = (factor**power * flat[s]).to(dtype)
    return out
