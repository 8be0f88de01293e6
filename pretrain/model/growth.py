"""Model growth as pure functions: (model config, MoE config, full state dict) -> a bigger (config, state dict).

Depth (any target: ``2x``, ``+N``, ``N``):
    ``stack``       block i of the grown model copies block i mod L: the trained stack repeated (shallow-to-deep
                    stacking: T. Xiao and J. Zhu, "Introduction to Transformers: an NLP Perspective",
                    arXiv:2311.17633, sec. 4.2.2, after Li et al. 2020b; G_stack: Du et al. 2024, arXiv:2405.15319).
                    Not function-preserving.
    ``interleave``  each block duplicated in place: block i copies block floor(i * L / N). Not function-preserving.
    ``identity``    the trained blocks, then new blocks (copies of the last one) whose residual branches start at
                    zero output (attention ``o_proj`` and FFN ``down_proj`` zeroed; a ``sandwich`` block's output
                    norms zeroed): exactly function-preserving for pre-norm and sandwich blocks. Post-norm and
                    DeepNorm blocks apply a norm even to a zero branch: refused.
DeepNorm keeps the parent's depth N in alpha = (2N)^(1/4) (``model.deepnorm_depth``) under every depth operator, so
each copied block computes exactly its source block's function.

Width (hidden size, FFN size, heads with the head size fixed):
    ``tile``        Xiao and Zhu's eq. (111) (arXiv:2311.17633, sec. 4.4) with rho = k: an integer factor k on a
                    dimension tiles every vector along it k times, and every k x k block of a grown matrix is W / k
                    (the input side is divided, so a tiled input gives a tiled output). Exactly function-preserving
                    for LayerNorm and RMSNorm (the mean and variance of a tiled vector are the same), rotary and
                    learned positions, GQA (query head j + cH reads key/value head j // g + c * KV, a copy of the
                    original pairing), biases, MoE routers and experts. Tied embeddings are untied: the input
                    embedding is tiled, the output projection tiled and divided by k (one matrix cannot be both).
                    ``model.embedding_scale: 0`` (sqrt(D)) changes with D: refused.
    ``net2net``     any factor (Net2WiderNet: Chen et al. 2016, arXiv:1511.05641): new units copy random existing
                    ones (seeded), and the consumers of a duplicated unit divide its column by the number of copies.
                    Exact for the FFN size (each unit feeds one linear map). Heads keep their size, so more heads
                    means a larger hidden size, and for the hidden size the norms' statistics over the duplicated
                    units change: approximate (the growth check reports the difference). Heads are copied whole;
                    with GQA (g = H/KV query heads per key/value head) whole groups are copied: a new group of g
                    query heads copies an old group and reads a new key/value head copying that group's, so the
                    pairing is kept (g unchanged); a head count that is not a multiple of g is refused.

Dense -> MoE upcycling (``experts=E``): every expert is a copy of the block's dense FFN and the router starts at
zero, so all experts get equal probability 1/E and the output is the dense FFN's exactly: top-k > 1 renormalizes the
weights to 1/k, top-1 (weighted by the probability, Switch) starts with the experts' ``down_proj`` multiplied by E.

``noise`` > 0 adds N(0, (noise * std(W))^2) to every grown or copied weight matrix (symmetry breaking: tiled copies
would otherwise receive identical gradients forever); the function is then preserved within the noise.
"""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction

import torch

from pretrain.config import LayerDropConfig, ModelConfig, MoEConfig
from pretrain.model.layerdrop import fold_branch_scales, inference_scales

StateDict = dict[str, torch.Tensor]
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.*)$")

GROWN_FIELDS = {
    "model": ("num_layers", "deepnorm_depth", "hidden_size", "num_heads", "num_kv_heads", "ffn_size", "tie_embeddings"),
    "moe": ("num_experts", "top_k", "every", "layers", "ffn_size", "normalize_top_k"),
}
"""The config fields growth changes (every operator below), by section: what a grown checkpoint's own config says
of them is the architecture a resume must build; every other field is the resume's to set."""


def resolve_count(spec: str | int, current: int) -> int:
    """``2x`` (a factor), ``+N`` (more) or ``N`` (a total) -> the target count."""
    text = str(spec).strip()
    try:
        if text.endswith("x"):  # exact: 1.1x of 1600 is 1760, not 1760.0000000000002
            target = Fraction(text[:-1]) * current
            if target.denominator != 1:
                raise ValueError(f"{text} of {current} is not a whole number")
            return int(target)
        if text.startswith("+"):
            return current + int(text[1:])
        return int(text)
    except ValueError as e:
        raise ValueError(f"{text!r}: expected a factor like 2x, an increment like +4, or a total ({e})") from None


# -- depth ---------------------------------------------------------------------------------------------------


def _blocks(state: StateDict) -> dict[int, StateDict]:
    out: dict[int, StateDict] = {}
    for key, value in state.items():
        m = _BLOCK.match(key)
        if m:
            out.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return out


def grow_depth(
    cfg: ModelConfig, moe: MoEConfig, state: StateDict, target: int, op: str = "stack"
) -> tuple[ModelConfig, MoEConfig, StateDict]:
    """Grow to ``target`` blocks with ``op`` (``stack``, ``interleave`` or ``identity``)."""
    n = cfg.num_layers
    if target < n:
        raise ValueError(f"depth {target} is smaller than the model's {n} blocks (growth only grows; see prune)")
    if op == "stack":
        source = [i % n for i in range(target)]
    elif op == "interleave":
        source = [i * n // target for i in range(target)]
    elif op == "identity":
        if cfg.norm_placement not in ("pre", "sandwich"):
            raise ValueError(
                f"depth_op identity preserves the function only for pre-norm and sandwich blocks "
                f"(model.norm_placement={cfg.norm_placement}); use stack or interleave"
            )
        source = list(range(n)) + [n - 1] * (target - n)
    else:
        raise ValueError(f"depth_op {op!r}: expected stack, interleave or identity")
    blocks = _blocks(state)
    out = {k: v for k, v in state.items() if not _BLOCK.match(k)}
    for i, src in enumerate(source):
        for name, value in blocks[src].items():
            value = value.clone()
            if op == "identity" and i >= n and _is_branch_output(name, cfg.norm_placement):
                value.zero_()
            out[f"blocks.{i}.{name}"] = value
    new_moe = moe
    if moe.enabled:
        layers = [i for i, src in enumerate(source) if moe.is_moe_layer(src)]
        new_moe = dataclasses.replace(moe, layers=layers, every=1)
    # DeepNorm: keep the parent's N (alpha, beta), so every copied block computes its source block's function
    kept = (cfg.deepnorm_depth or n) if cfg.norm_placement == "deepnorm" else cfg.deepnorm_depth
    return dataclasses.replace(cfg, num_layers=target, deepnorm_depth=kept), new_moe, out


def _is_branch_output(name: str, placement: str) -> bool:
    """The tensors whose zeroing makes a block's residual branches output zero."""
    if placement == "sandwich":
        return name.startswith(("norm_out1.", "norm_out2."))
    return name.startswith("attn.o_proj.") or (
        name.endswith(("down_proj.weight", "down_proj.bias")) and name.startswith("ffn.")
    )


# -- width ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Axis:
    """How one dimension grows: ``index[j]`` = the old unit new unit j copies; ``count[i]`` = copies of old i."""

    index: torch.Tensor  # (new,) int64
    count: torch.Tensor  # (old,) float

    def to(self, device: torch.device) -> _Axis:
        return _Axis(self.index.to(device), self.count.to(device))

    @staticmethod
    def tile(old: int, k: int) -> _Axis:
        return _Axis(torch.arange(old * k) % old, torch.full((old,), float(k)))

    @staticmethod
    def net2net(old: int, new: int, g: torch.Generator, group: int = 1) -> _Axis:
        """Duplicate random old units (whole groups of ``group`` consecutive units, e.g. a head's dims)."""
        if new % group or old % group:
            raise ValueError(f"width {old} -> {new} must keep whole groups of {group}")
        extra = torch.randint(0, old // group, ((new - old) // group,), generator=g)
        groups = torch.cat([torch.arange(old // group), extra])
        index = (groups.view(-1, 1) * group + torch.arange(group)).flatten()
        return _Axis(index, torch.bincount(index, minlength=old).float())

    @staticmethod
    def net2net_heads(
        heads: int, kv_heads: int, new_heads: int, head_dim: int, g: torch.Generator
    ) -> tuple[_Axis, _Axis]:
        """Query and key/value head dims for ``heads`` -> ``new_heads`` query heads of ``head_dim``, query head j
        reading key/value head j // (heads / kv_heads) (``repeat_interleave``): whole groups of query heads are
        copied (random old groups, seeded) together with their key/value head, so every new query head reads a copy
        of the key/value head its source read. Without GQA (kv_heads == heads) the groups are single heads."""
        group = heads // kv_heads
        if (new_heads - heads) % group:
            raise ValueError(
                f"width_op net2net with grouped-query attention (model.num_heads {heads}, model.num_kv_heads "
                f"{kv_heads}) adds query heads in whole groups of {group} (each group reads one copied key/value "
                f"head): heads {heads} -> {new_heads} is not a multiple of {group}; set heads (or width) to a "
                f"multiple of {group} heads ({group * head_dim} hidden units), or use width_op tile"
            )
        extra = torch.randint(0, kv_heads, ((new_heads - heads) // group,), generator=g)
        kv_src = torch.cat([torch.arange(kv_heads), extra])  # new kv head -> old kv head
        q_src = (kv_src.view(-1, 1) * group + torch.arange(group)).flatten()  # new query head -> old query head

        def dims(src: torch.Tensor, old: int) -> _Axis:
            index = (src.view(-1, 1) * head_dim + torch.arange(head_dim)).flatten()
            return _Axis(index, torch.bincount(index, minlength=old * head_dim).float())

        return dims(q_src, heads), dims(kv_src, kv_heads)


def _grow_matrix(w: torch.Tensor, out_axis: _Axis | None, in_axis: _Axis | None) -> torch.Tensor:
    """Rows copied along ``out_axis``; columns copied along ``in_axis`` and divided by their copy counts (so a
    copied input gives the same pre-activations; for ``tile`` these are the W / k blocks of Xiao and Zhu's eq. 111,
    arXiv:2311.17633, sec. 4.4)."""
    if in_axis is not None:
        w = w[:, in_axis.index] / in_axis.count[in_axis.index].to(w.dtype)
    if out_axis is not None:
        w = w[out_axis.index]
    return w


def grow_width(
    cfg: ModelConfig,
    moe: MoEConfig,
    state: StateDict,
    *,
    hidden: int | None = None,
    heads: int | None = None,
    ffn: int | None = None,
    op: str = "tile",
    seed: int = 0,
) -> tuple[ModelConfig, MoEConfig, StateDict]:
    """Grow the hidden size, the number of heads (head size fixed) and/or the FFN size. ``hidden`` alone also
    grows the heads and the FFN by the same factor. ``op``: ``tile`` (integer factors) or ``net2net``."""
    from pretrain.model.transformer import resolved_ffn_size

    d, h = cfg.hidden_size, cfg.num_heads
    hd = d // h
    kv = cfg.num_kv_heads or h
    f = resolved_ffn_size(cfg)
    new_d = hidden or d
    new_h = heads or (h * new_d // d if hidden else h)
    new_f = ffn or (f * new_d // d if hidden else f)
    if new_h * hd != new_d:
        raise ValueError(f"heads {new_h} x head size {hd} != hidden size {new_d}: the head size stays fixed")
    if (new_d, new_h, new_f) == (d, h, f):
        return cfg, moe, dict(state)
    if min(new_d - d, new_h - h, new_f - f) < 0:
        raise ValueError("width growth only grows (hidden, heads, ffn)")
    if cfg.embedding_scale == 0.0 and new_d != d:
        raise ValueError("model.embedding_scale 0 (sqrt(hidden_size)) changes with the width: set it explicitly")
    g = torch.Generator().manual_seed(seed)
    if op == "tile":
        for name, old, new in (("hidden size", d, new_d), ("heads", h, new_h), ("ffn size", f, new_f)):
            if new % old:
                raise ValueError(f"width_op tile needs integer factors: {name} {old} -> {new} (use width_op net2net)")
        if new_h // h != new_d // d:
            raise ValueError("width_op tile grows heads and hidden size by the same factor (head size fixed)")
        hid = _Axis.tile(d, new_d // d)
        qh = _Axis.tile(h * hd, new_h // h)  # query head dims: heads copied in order
        kvh = _Axis.tile(kv * hd, new_h // h)
        ff = _Axis.tile(f, new_f // f)
        ef = _Axis.tile(moe.ffn_size or f, new_f // f) if moe.enabled else None
        new_kv = kv * new_h // h
    elif op == "net2net":
        hid = _Axis.net2net(d, new_d, g)
        qh, kvh = _Axis.net2net_heads(h, kv, new_h, hd, g)  # k/v projections: kv heads of hd, own axis
        ff = _Axis.net2net(f, new_f, g)
        ef = _Axis.net2net(moe.ffn_size or f, (moe.ffn_size or f) * new_f // f, g) if moe.enabled else None
        new_kv = cfg.num_kv_heads and new_h // (h // kv)  # the group size h / kv is kept
    else:
        raise ValueError(f"width_op {op!r}: expected tile or net2net")
    device = next(iter(state.values())).device if state else torch.device("cpu")  # e.g. meta: shapes only
    hid, qh, kvh, ff = (axis.to(device) for axis in (hid, qh, kvh, ff))
    ef = ef.to(device) if ef is not None else None
    out: StateDict = {}
    for key, w in state.items():
        out[key] = _grow_tensor(key, w, hid, qh, kvh, ff, ef, cfg)
    new_cfg = dataclasses.replace(
        cfg,
        hidden_size=new_d,
        num_heads=new_h,
        num_kv_heads=new_kv,
        ffn_size=new_f if (cfg.ffn_size or new_f != f) else 0,
    )
    if cfg.tie_embeddings and new_d != d:  # one matrix cannot be the tiled input and the divided output map
        out["lm_head.weight"] = _grow_matrix(state["embed_tokens.weight"], None, hid)
        new_cfg = dataclasses.replace(new_cfg, tie_embeddings=False)
    new_moe = dataclasses.replace(moe, ffn_size=moe.ffn_size * new_f // f) if moe.enabled and moe.ffn_size else moe
    return new_cfg, new_moe, out


def _grow_tensor(
    key: str, w: torch.Tensor, hid: _Axis, qh: _Axis, kvh: _Axis, ff: _Axis, ef: _Axis | None, cfg: ModelConfig
) -> torch.Tensor:
    name = key.split(".")
    leaf = name[-1]
    in_expert = "deepspeed_experts" in key
    f_axis = ef if in_expert else ff
    if key in ("embed_tokens.weight", "embed_positions.weight"):
        return w[:, hid.index].clone()  # (V or S, D): every embedding vector tiled / copied
    if key == "lm_head.weight":
        return _grow_matrix(w, None, hid)
    if key == "lm_head.bias":
        return w.clone()
    if ".attn.q_norm." in key or ".attn.k_norm." in key:
        return w.clone()  # per head, over the head size: unchanged
    if ".attn.q_proj." in key:
        return _grow_matrix(w, qh, hid) if leaf == "weight" else w[qh.index].clone()
    if ".attn.k_proj." in key or ".attn.v_proj." in key:
        return _grow_matrix(w, kvh, hid) if leaf == "weight" else w[kvh.index].clone()
    if ".attn.o_proj." in key:
        return _grow_matrix(w, hid, qh) if leaf == "weight" else w[hid.index].clone()
    if key.endswith(("gate_proj.weight", "up_proj.weight")):
        return _grow_matrix(w, f_axis, hid)
    if key.endswith(("gate_proj.bias", "up_proj.bias")):
        assert f_axis is not None  # ef is None only without MoE, whose keys have no experts
        return w[f_axis.index].clone()
    if key.endswith("down_proj.weight"):
        return _grow_matrix(w, hid, f_axis)
    if key.endswith("down_proj.bias"):
        return w[hid.index].clone()
    if key.endswith("gate.wg.weight"):  # MoE router (E, D)
        return _grow_matrix(w, None, hid)
    if key.endswith(("gate.selection_bias", "gate.expert_bias")):  # per expert (E,): not a hidden-size axis
        return w.clone()
    if key.startswith("head_transform.dense."):
        return _grow_matrix(w, hid, hid) if leaf == "weight" else w[hid.index].clone()
    if w.dim() == 1:  # norms over the hidden size (weights and biases)
        return w[hid.index].clone()
    raise ValueError(f"growth: no width rule for {key} {tuple(w.shape)}")


# -- dense -> MoE ---------------------------------------------------------------------------------------------


def upcycle(
    cfg: ModelConfig, moe: MoEConfig, state: StateDict, num_experts: int, top_k: int = 2
) -> tuple[ModelConfig, MoEConfig, StateDict]:
    """Every dense FFN becomes an MoE layer of ``num_experts`` copies of it with a zero router (Komatsuzaki et al.
    2023, sparse upcycling): the output equals the dense FFN's at the start. Top-k > 1 renormalizes the k equal
    probabilities 1/E to 1/k each; top-1 weights by the probability itself (Switch), 1/E, so each expert's output
    projection (``down_proj``, weight and bias) starts multiplied by E."""
    if moe.enabled:
        raise ValueError("experts: the model is already a Mixture-of-Experts")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"experts {num_experts} with top_k {top_k}: need 1 <= top_k <= experts")
    out: StateDict = {}
    for key, w in state.items():
        m = _BLOCK.match(key)
        if m and m.group(2).startswith("ffn."):
            rest = m.group(2)[len("ffn.") :]
            scale = num_experts if top_k == 1 and rest.startswith("down_proj.") else 1
            for e in range(num_experts):
                out[f"blocks.{m.group(1)}.ffn.deepspeed_moe.experts.deepspeed_experts.{e}.{rest}"] = w * scale
            continue
        out[key] = w
    for i in range(cfg.num_layers):
        out[f"blocks.{i}.ffn.deepspeed_moe.gate.wg.weight"] = torch.zeros(num_experts, cfg.hidden_size)
        if moe.balance != "aux_loss":  # the selection bias of moe.balance: bias|both starts at zero
            out[f"blocks.{i}.ffn.deepspeed_moe.gate.selection_bias"] = torch.zeros(num_experts)
    from pretrain.model.transformer import resolved_ffn_size

    new_moe = dataclasses.replace(
        moe,
        num_experts=num_experts,
        top_k=top_k,
        every=1,
        layers=[],
        ffn_size=resolved_ffn_size(cfg),
        normalize_top_k=True,
    )
    return cfg, new_moe, out


# -- symmetry breaking ----------------------------------------------------------------------------------------


def add_noise(before: StateDict, after: StateDict, scale: float, seed: int) -> StateDict:
    """N(0, (scale * std(W))^2) on every weight matrix of ``after`` that growth created or reshaped (not on
    unchanged tensors, biases or norms). ``scale`` 0 returns ``after`` unchanged."""
    if scale <= 0:
        return after
    g = torch.Generator().manual_seed(seed)
    out = dict(after)
    for key in sorted(after):
        w = after[key]
        if w.dim() < 2 or (key in before and before[key].shape == w.shape and torch.equal(before[key], w)):
            continue
        std = float(w.float().std()) if w.numel() > 1 else 0.0
        if std == 0.0 or not math.isfinite(std):
            std = float(before.get(key, w).float().std()) if key in before else 0.02
        out[key] = w + scale * std * torch.randn(w.shape, generator=g, dtype=w.dtype)
    return out


# -- one growth entry ---------------------------------------------------------------------------------------------


def count_parameters(state: StateDict, tied: bool) -> int:
    """Parameters in a full state dict (a tied output projection counted once)."""
    return sum(v.numel() for k, v in state.items() if not (tied and k == "lm_head.weight"))


@dataclasses.dataclass(frozen=True)
class Grown:
    model: ModelConfig
    moe: MoEConfig
    state: StateDict
    exact: bool
    """Whether the operators used preserve the function exactly (before noise)."""
    operator: str
    """A short description, e.g. ``depth 4->8 stack; width 256->512 tile``."""


def apply_growth(
    cfg: ModelConfig, moe: MoEConfig, state: StateDict, step, seed: int, layer_drop: LayerDropConfig | None = None
) -> Grown:
    """Apply one ``GrowthStep`` (depth, then width, then upcycling, then noise) to a full state dict.

    ``layer_drop`` (the run's): with ``scaling: rho`` and ``by_depth: linear`` the inference scale of a block
    depends on the depth (rho of Xiao and Zhu's eq. 95, arXiv:2311.17633, sec. 4.2.4, is the keep probability
    1 - rate (l + 1) / L of 0-based block l of L), so a depth growth is done on the weights with the parent's
    scales folded in (as ``prune`` does), and the grown weights are divided by the child's scales: every block
    keeps the effective scale of the block it copies and the grown model, scaled at inference, is the parent's
    function wherever the operator is exact."""
    from pretrain.model.transformer import resolved_ffn_size

    target = resolve_count(step.depth, cfg.num_layers) if step.depth else cfg.num_layers
    old_scales = inference_scales(layer_drop, cfg.num_layers) if layer_drop is not None else None
    new_scales = inference_scales(layer_drop, target) if layer_drop is not None else None
    rescale = bool(old_scales and new_scales and len(set(old_scales + new_scales)) > 1)
    if rescale:  # grown (and noised, against the folded parent) in the folded space; unfolded at the end
        assert old_scales is not None  # rescale implies both scale lists
        state = fold_branch_scales(state, cfg.norm_placement, old_scales)
    new_cfg, new_moe, sd, exact, ops = cfg, moe, state, True, []
    if step.depth:
        new_cfg, new_moe, sd = grow_depth(new_cfg, new_moe, sd, target, step.depth_op)
        exact &= step.depth_op == "identity"
        ops.append(f"depth {cfg.num_layers}->{target} {step.depth_op}")
    if step.width or step.heads or step.ffn:
        d, h, f = new_cfg.hidden_size, new_cfg.num_heads, resolved_ffn_size(new_cfg)
        hidden = resolve_count(step.width, d) if step.width else None
        heads = resolve_count(step.heads, h) if step.heads else None
        if heads and not hidden:
            hidden = heads * (d // h)
        ffn = resolve_count(step.ffn, f) if step.ffn else None
        new_cfg, new_moe, sd = grow_width(
            new_cfg, new_moe, sd, hidden=hidden, heads=heads, ffn=ffn, op=step.width_op, seed=seed
        )
        exact &= step.width_op == "tile" or new_cfg.hidden_size == d
        ops.append(
            f"width {d}->{new_cfg.hidden_size} heads {h}->{new_cfg.num_heads} ffn {f}->"
            f"{resolved_ffn_size(new_cfg)} {step.width_op}"
        )
    if step.experts:
        new_cfg, new_moe, sd = upcycle(new_cfg, new_moe, sd, step.experts, step.top_k)
        ops.append(f"experts {step.experts} top-{step.top_k} upcycle")
    sd = add_noise(state, sd, step.noise, seed)
    if rescale:
        assert new_scales is not None  # rescale implies both scale lists
        sd = fold_branch_scales(sd, new_cfg.norm_placement, [(1.0 / a, 1.0 / f) for a, f in new_scales])
    return Grown(new_cfg, new_moe, sd, exact, "; ".join(ops) + (f"; noise {step.noise:g}" if step.noise else ""))
