"""Declarative weight maps between our state dict and standard Hugging Face classes.

One :class:`Family` per exact HF equivalent. A family says which of our configs it represents
*exactly* (``requires``: same function, not an approximation), how to build the HF config, and how
keys map (a list of :class:`Rule`). Everything here is a pure function of (config, state dict):
no I/O, no HF model objects, so each piece is testable alone.

Exact rewrites of our model applied before mapping (``fill_zero_biases``, ``expand_kv_heads``,
``fold_deepnorm``) are in :mod:`pretrain.export.rewrites`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.config import ModelConfig
from pretrain.export.rewrites import expand_kv_heads, fill_zero_biases, fold_deepnorm
from pretrain.export.rules import Rule, StateDict, apply_rules, invert_rules  # noqa: F401 (re-exported)
from pretrain.model.transformer import resolved_ffn_size

# ----------------------------------------------------------------------------------------------
# Families
# ----------------------------------------------------------------------------------------------

Requirement = tuple[str, Any, str]
"""(ModelConfig field, allowed value or tuple of values, why)."""


@dataclass(frozen=True)
class Family:
    """An exact standard HF class for a subset of our configs."""

    name: str
    hf_class: str
    model_type: str
    requires: tuple[Requirement, ...]
    hf_config: Callable[[ModelConfig, dict], dict]
    """(our config, special token ids) -> kwargs of the HF config class."""
    rules: Callable[[ModelConfig], list[Rule]]
    """Key map for a (rewritten) config."""
    rewrite: Callable[[StateDict, ModelConfig], tuple[StateDict, ModelConfig]]
    """Exact rewrites applied before mapping (see the module docstring)."""
    config_from_hf: Callable[[dict], dict]
    """HF ``config.json`` dict -> our ModelConfig fields; ValueError when not exactly representable."""
    absorb_consts: Callable[[StateDict, StateDict], StateDict] = lambda sd, consts: sd
    """On import: fold the HF-only tensors (``Rule.const``) into our state dict, exactly."""
    extra_checks: Callable[[ModelConfig], list[str]] = lambda cfg: []

    def violations(self, cfg: ModelConfig) -> list[str]:
        """Why ``cfg`` is not exactly this family (empty: it is)."""
        out = []
        for field_name, allowed, why in self.requires:
            value = getattr(cfg, field_name)
            ok = value in allowed if isinstance(allowed, tuple) else value == allowed
            if not ok:
                want = " or ".join(map(repr, allowed)) if isinstance(allowed, tuple) else repr(allowed)
                out.append(f"model.{field_name}={value!r} (needs {want}{': ' + why if why else ''})")
        return out + self.extra_checks(cfg)

    def to_hf(self, sd: StateDict, cfg: ModelConfig, special: dict) -> tuple[dict, StateDict]:
        """(HF config kwargs, HF state dict) for an exactly representable ``cfg``."""
        bad = self.violations(cfg)
        if bad:
            raise ValueError(f"{self.hf_class} cannot represent this model exactly: {'; '.join(bad)}")
        sd = {k[len("module.") :] if k.startswith("module.") else k: v for k, v in sd.items()}
        sd, rcfg = self.rewrite(sd, cfg)
        return self.hf_config(cfg, special), apply_rules(sd, self.rules(rcfg), rcfg)


def _special(special: dict) -> dict:
    return {k: special.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def _require(hf: dict, key: str, allowed: tuple, family: str) -> None:
    value = hf.get(key)
    if value not in allowed:
        raise ValueError(
            f"{family} config {key}={value!r} has no exact equivalent in our model "
            f"(supported: {', '.join(map(repr, allowed))})"
        )


# --- Llama: pre-LN RMSNorm, rotary, SwiGLU, no biases, tied or untied, GQA ---------------------


def _llama_config(cfg: ModelConfig, special: dict) -> dict:
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=resolved_ffn_size(cfg),
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads or cfg.num_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=cfg.attention_dropout,
        initializer_range=cfg.init_std,
        **_special(special),
    )


def _llama_rules(cfg: ModelConfig) -> list[Rule]:
    L = "model.layers.{i}."
    rules = [
        Rule(("embed_tokens.weight",), "model.embed_tokens.weight"),
        Rule(("blocks.{i}.norm1.weight",), L + "input_layernorm.weight"),
        Rule(("blocks.{i}.norm2.weight",), L + "post_attention_layernorm.weight"),
        *[Rule((f"blocks.{{i}}.attn.{p}_proj.weight",), L + f"self_attn.{p}_proj.weight") for p in "qkvo"],
        *[Rule((f"blocks.{{i}}.ffn.{p}_proj.weight",), L + f"mlp.{p}_proj.weight") for p in ("gate", "up", "down")],
        Rule(("final_norm.weight",), "model.norm.weight"),
        Rule(("lm_head.weight",), "lm_head.weight"),
    ]
    return rules


def _rope_theta(hf: dict, family: str) -> float:
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        rope = scaling
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype != "default":
        raise ValueError(f"{family} rope type {rtype!r} has no exact equivalent (only default RoPE)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{family} partial rotary embeddings have no exact equivalent")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_from_hf(hf: dict) -> dict:
    _require(hf, "hidden_act", ("silu",), "Llama")
    _require(hf, "attention_bias", (False, None), "Llama")
    _require(hf, "mlp_bias", (False, None), "Llama")
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, d // heads):
        raise ValueError(f"Llama head_dim={hf['head_dim']} != hidden_size/num_attention_heads: no exact equivalent")
    kv = hf.get("num_key_value_heads") or heads
    return dict(
        kind="decoder",
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"],
        num_layers=hf["num_hidden_layers"],
        hidden_size=d,
        num_heads=heads,
        num_kv_heads=0 if kv == heads else kv,
        ffn_size=hf["intermediate_size"],
        activation="swiglu",
        norm="rmsnorm",
        norm_placement="pre",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        position="rotary",
        rope_theta=_rope_theta(hf, "Llama"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bias=False,
        dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        embedding_norm=False,
        final_norm=True,
        mlm_head_transform=False,
    )


LLAMA = Family(
    name="llama",
    hf_class="LlamaForCausalLM",
    model_type="llama",
    requires=(
        ("kind", "decoder", ""),
        ("norm", "rmsnorm", ""),
        ("norm_placement", "pre", ""),
        ("position", "rotary", ""),
        ("activation", "swiglu", ""),
        ("bias", False, "Llama has no biases"),
        ("output_bias", False, "Llama's LM head has no bias"),
        ("embedding_norm", False, ""),
        ("final_norm", True, ""),
        ("mlm_head_transform", False, ""),
    ),
    hf_config=_llama_config,
    rules=_llama_rules,
    rewrite=lambda sd, cfg: (dict(sd), cfg),
    config_from_hf=_llama_from_hf,
)


# --- GPT-2: pre-LN LayerNorm, learned positions, exact GELU, MHA (GQA expanded) ----------------


def _gpt2_config(cfg: ModelConfig, special: dict) -> dict:
    return dict(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        n_inner=resolved_ffn_size(cfg),
        activation_function="gelu",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.attention_dropout,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        **_special(special),
    )


def _gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    H = "transformer.h.{i}."
    qkv = tuple(f"blocks.{{i}}.attn.{p}_proj" for p in "qkv")
    rules = [
        Rule(("embed_tokens.weight",), "transformer.wte.weight"),
        Rule(("embed_positions.weight",), "transformer.wpe.weight"),
    ]
    for s in ("weight", "bias"):
        rules += [
            Rule((f"blocks.{{i}}.norm1.{s}",), H + f"ln_1.{s}"),
            Rule(tuple(f"{k}.{s}" for k in qkv), H + f"attn.c_attn.{s}", "cat_t" if s == "weight" else "cat"),
            Rule((f"blocks.{{i}}.attn.o_proj.{s}",), H + f"attn.c_proj.{s}", "t" if s == "weight" else "copy"),
            Rule((f"blocks.{{i}}.norm2.{s}",), H + f"ln_2.{s}"),
            Rule((f"blocks.{{i}}.ffn.up_proj.{s}",), H + f"mlp.c_fc.{s}", "t" if s == "weight" else "copy"),
            Rule((f"blocks.{{i}}.ffn.down_proj.{s}",), H + f"mlp.c_proj.{s}", "t" if s == "weight" else "copy"),
            Rule((f"final_norm.{s}",), f"transformer.ln_f.{s}"),
        ]
    rules.append(Rule(("lm_head.weight",), "lm_head.weight"))
    return rules


def _gpt2_rewrite(sd: StateDict, cfg: ModelConfig) -> tuple[StateDict, ModelConfig]:
    sd, cfg = expand_kv_heads(sd, cfg)
    return fill_zero_biases(sd, cfg, skip=("lm_head.bias",))


def _gpt2_from_hf(hf: dict) -> dict:
    _require(hf, "activation_function", ("gelu",), "GPT-2")
    _require(hf, "scale_attn_weights", (True, None), "GPT-2")
    _require(hf, "scale_attn_by_inverse_layer_idx", (False, None), "GPT-2")
    _require(hf, "add_cross_attention", (False, None), "GPT-2")
    d = hf["n_embd"]
    return dict(
        kind="decoder",
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["n_positions"],
        num_layers=hf["n_layer"],
        hidden_size=d,
        num_heads=hf["n_head"],
        num_kv_heads=0,
        ffn_size=hf.get("n_inner") or 4 * d,
        activation="gelu",
        norm="layernorm",
        norm_placement="pre",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        position="learned",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        bias=True,
        lm_head_bias=False,
        dropout=float(hf.get("resid_pdrop", 0.0)),
        attention_dropout=float(hf.get("attn_pdrop", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        embedding_norm=False,
        final_norm=True,
        mlm_head_transform=False,
    )


GPT2 = Family(
    name="gpt2",
    hf_class="GPT2LMHeadModel",
    model_type="gpt2",
    requires=(
        ("kind", "decoder", ""),
        ("norm", "layernorm", ""),
        ("norm_placement", "pre", ""),
        ("position", "learned", ""),
        ("activation", "gelu", ""),
        ("output_bias", False, "GPT-2's LM head has no bias: set model.lm_head_bias=false"),
        ("embedding_norm", False, ""),
        ("final_norm", True, ""),
        ("mlm_head_transform", False, ""),
    ),
    hf_config=_gpt2_config,
    rules=_gpt2_rules,
    rewrite=_gpt2_rewrite,
    config_from_hf=_gpt2_from_hf,
)


# --- BERT: post-LN (or folded DeepNorm) LayerNorm encoder, learned positions, GELU, MLM transform --


def _bert_config(cfg: ModelConfig, special: dict) -> dict:
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=resolved_ffn_size(cfg),
        hidden_act="gelu",
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attention_dropout,
        max_position_embeddings=cfg.max_seq_len,
        type_vocab_size=1,
        layer_norm_eps=cfg.norm_eps,
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        is_decoder=False,
        pad_token_id=special.get("pad_token_id"),
    )


def _zero_token_types(cfg: ModelConfig) -> torch.Tensor:
    # type_vocab_size=1 and token_type_ids default to 0: adding this zero row changes nothing.
    return torch.zeros(1, cfg.hidden_size)


def _bert_rules(cfg: ModelConfig) -> list[Rule]:
    E, L, P = "bert.embeddings.", "bert.encoder.layer.{i}.", "cls.predictions."
    rules = [
        Rule(("embed_tokens.weight",), E + "word_embeddings.weight"),
        Rule(("embed_positions.weight",), E + "position_embeddings.weight"),
        Rule((), E + "token_type_embeddings.weight", const=_zero_token_types),
    ]
    for s in ("weight", "bias"):
        rules += [
            Rule((f"embedding_norm.{s}",), E + f"LayerNorm.{s}"),
            *[
                Rule((f"blocks.{{i}}.attn.{p}_proj.{s}",), L + f"attention.self.{n}.{s}")
                for p, n in (("q", "query"), ("k", "key"), ("v", "value"))
            ],
            Rule((f"blocks.{{i}}.attn.o_proj.{s}",), L + f"attention.output.dense.{s}"),
            Rule((f"blocks.{{i}}.norm1.{s}",), L + f"attention.output.LayerNorm.{s}"),
            Rule((f"blocks.{{i}}.ffn.up_proj.{s}",), L + f"intermediate.dense.{s}"),
            Rule((f"blocks.{{i}}.ffn.down_proj.{s}",), L + f"output.dense.{s}"),
            Rule((f"blocks.{{i}}.norm2.{s}",), L + f"output.LayerNorm.{s}"),
            Rule((f"head_transform.dense.{s}",), P + f"transform.dense.{s}"),
            Rule((f"head_transform.norm.{s}",), P + f"transform.LayerNorm.{s}"),
        ]
    rules += [
        Rule(("lm_head.weight",), P + "decoder.weight"),
        # BERT keeps the output bias as `cls.predictions.bias` (tied to `decoder.bias`).
        Rule(("lm_head.bias",), P + "bias"),
        Rule(("lm_head.bias",), P + "decoder.bias", alias=True),
    ]
    return rules


def _bert_rewrite(sd: StateDict, cfg: ModelConfig) -> tuple[StateDict, ModelConfig]:
    sd, cfg = fold_deepnorm(sd, cfg)
    sd, cfg = expand_kv_heads(sd, cfg)
    return fill_zero_biases(sd, cfg)


def _bert_from_hf(hf: dict) -> dict:
    _require(hf, "hidden_act", ("gelu",), "BERT")
    _require(hf, "is_decoder", (False, None), "BERT")
    _require(hf, "position_embedding_type", ("absolute", None), "BERT")
    return dict(
        kind="encoder",
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"],
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=0,
        ffn_size=hf["intermediate_size"],
        activation="gelu",
        norm="layernorm",
        norm_placement="post",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        position="learned",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        bias=True,
        dropout=float(hf.get("hidden_dropout_prob", 0.0)),
        attention_dropout=float(hf.get("attention_probs_dropout_prob", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        embedding_norm=True,
        final_norm=True,
        mlm_head_transform=True,
    )


def _bert_absorb(sd: StateDict, consts: StateDict) -> StateDict:
    """Token type 0 (the default ``token_type_ids``) is a constant row added at every position, so it
    can live in the position table instead: the same function up to float rounding of the sum (and
    bitwise when the row is zero, as in our exports)."""
    tt = consts.get("bert.embeddings.token_type_embeddings.weight")
    if tt is None or not torch.any(tt[0] != 0):
        return sd
    return {**sd, "embed_positions.weight": sd["embed_positions.weight"] + tt[0]}


BERT = Family(
    name="bert",
    hf_class="BertForMaskedLM",
    model_type="bert",
    requires=(
        ("kind", "encoder", ""),
        ("norm", "layernorm", ""),
        ("norm_placement", ("post", "deepnorm"), "BERT is post-LN; DeepNorm is folded exactly"),
        ("position", "learned", ""),
        ("activation", "gelu", ""),
        ("embedding_norm", True, "BERT always normalizes the embeddings"),
        ("mlm_head_transform", True, "BERT always has the dense+GELU+norm head transform"),
    ),
    hf_config=_bert_config,
    rules=_bert_rules,
    rewrite=_bert_rewrite,
    config_from_hf=_bert_from_hf,
    absorb_consts=_bert_absorb,
)


FAMILIES: tuple[Family, ...] = (LLAMA, GPT2, BERT)
"""Standard families, in order of preference."""

FAMILY_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}


def find_family(cfg: ModelConfig) -> tuple[Family | None, list[str]]:
    """The first family that represents ``cfg`` exactly, else (None, why each does not)."""
    reasons = []
    for fam in FAMILIES:
        bad = fam.violations(cfg)
        if not bad:
            return fam, []
        if fam.requires[0][1] == cfg.kind:  # only explain families of the right kind
            reasons.append(f"{fam.hf_class}: {'; '.join(bad)}")
    return None, reasons
