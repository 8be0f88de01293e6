"""Exact rewrites of our (state dict, config) applied before mapping to a Hugging Face class.

Each returns an equivalent ``(state_dict, config)`` of *our* model (the tests check it by running our model on
both):

* :func:`fill_zero_biases` -- HF classes whose linears/norms always have biases get zeros
  (``x + 0 == x`` exactly in floating point).
* :func:`expand_kv_heads` -- grouped-query K/V projections are repeated per query head (HF
  ``repeat_kv`` layout), giving plain multi-head attention with identical values.
* :func:`fold_deepnorm` -- DeepNorm's ``norm(alpha*x + f(x))`` becomes post-LN ``norm(x + f(x))`` by
  carrying the residual stream scaled by alpha: every norm that feeds the residual stream gets its
  affine weight/bias scaled by alpha, and every linear that reads the stream (q/k/v, up/gate, the head
  transform) gets its weight divided by alpha. This is exact in real arithmetic (float rounding only)
  and needs no per-norm epsilon; the textbook alternative (fold 1/alpha into o/down projections and use
  ``eps/alpha^2``, by LayerNorm's scale invariance) is not expressible in BERT, whose single
  ``layer_norm_eps`` is shared with the embedding and head-transform norms.
"""

from __future__ import annotations

import dataclasses

import torch

from pretrain.config import ModelConfig
from pretrain.export.rules import Rule, StateDict, apply_rules, invert_rules  # noqa: F401 (re-exported)


def fill_zero_biases(sd: StateDict, cfg: ModelConfig, skip: tuple[str, ...] = ()) -> tuple[StateDict, ModelConfig]:
    """Add an all-zero ``X.bias`` next to every ``X.weight`` of a Linear or LayerNorm that lacks one.

    Embeddings and RMSNorms never have biases; keys in ``skip`` stay absent (e.g. ``lm_head.bias`` for
    a target class whose output layer has no bias).
    """
    if cfg.bias and (cfg.output_bias or "lm_head.bias" in skip):
        return dict(sd), cfg
    if cfg.norm != "layernorm":
        raise ValueError("zero biases are only defined for LayerNorm models")
    out = dict(sd)
    for key, w in sd.items():
        if not key.endswith(".weight") or key.startswith(("embed_tokens.", "embed_positions.")):
            continue
        bias_key = key[: -len("weight")] + "bias"
        if bias_key not in sd and bias_key not in skip:
            out[bias_key] = torch.zeros(w.shape[0], dtype=w.dtype)
    return out, dataclasses.replace(cfg, bias=True, lm_head_bias="lm_head.bias" in out)


def expand_kv_heads(sd: StateDict, cfg: ModelConfig) -> tuple[StateDict, ModelConfig]:
    """Grouped-query attention -> multi-head attention with each K/V head repeated (exact)."""
    kv = cfg.num_kv_heads or cfg.num_heads
    if kv == cfg.num_heads:
        return dict(sd), cfg
    g, hd = cfg.num_heads // kv, cfg.hidden_size // cfg.num_heads
    out = dict(sd)
    for i in range(cfg.num_layers):
        for name in ("k_proj", "v_proj"):
            for suffix in ("weight", "bias"):
                key = f"blocks.{i}.attn.{name}.{suffix}"
                if key in sd:
                    t = sd[key]
                    heads = t.reshape(kv, hd, *t.shape[1:])
                    out[key] = heads.repeat_interleave(g, dim=0).reshape(cfg.num_heads * hd, *t.shape[1:])
    return out, dataclasses.replace(cfg, num_kv_heads=0)


def deepnorm_alpha(cfg: ModelConfig) -> float:
    """The residual scale of :class:`pretrain.model.layers.Block` (1 unless DeepNorm)."""
    return (2.0 * (cfg.deepnorm_depth or cfg.num_layers)) ** 0.25 if cfg.norm_placement == "deepnorm" else 1.0


def fold_deepnorm(sd: StateDict, cfg: ModelConfig) -> tuple[StateDict, ModelConfig]:
    """DeepNorm -> equivalent post-LN (see the module docstring). Needs ``embedding_norm`` (the first
    norm of the stream) and a head transform or an untied head (the last reader of the stream)."""
    if cfg.norm_placement != "deepnorm":
        return dict(sd), cfg
    if not cfg.embedding_norm:
        raise ValueError("folding DeepNorm needs model.embedding_norm (the residual stream starts at a norm)")
    if not cfg.mlm_head_transform and cfg.tie_embeddings:
        raise ValueError("folding DeepNorm needs a head transform or an untied LM head")
    a = deepnorm_alpha(cfg)
    out = dict(sd)

    def scale(prefix: str, factor: float, keys: tuple[str, ...]) -> None:
        for k in keys:
            key = f"{prefix}.{k}"
            if key in sd:
                out[key] = sd[key] * factor

    scale("embedding_norm", a, ("weight", "bias"))
    for i in range(cfg.num_layers):
        b = f"blocks.{i}"
        for p in ("q_proj", "k_proj", "v_proj"):
            scale(f"{b}.attn.{p}", 1.0 / a, ("weight",))
        for p in ("gate_proj", "up_proj"):
            scale(f"{b}.ffn.{p}", 1.0 / a, ("weight",))
        scale(f"{b}.norm1", a, ("weight", "bias"))
        scale(f"{b}.norm2", a, ("weight", "bias"))
    scale("head_transform.dense" if cfg.mlm_head_transform else "lm_head", 1.0 / a, ("weight",))
    return out, dataclasses.replace(cfg, norm_placement="post")
