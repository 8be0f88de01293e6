"""Mixture-of-Experts export: exact maps to Mixtral and Qwen3-MoE and remote-code fields (pure functions of config
and state dict; gathering the experts of an expert-parallel checkpoint is ``pretrain/checkpoint/weights.py``'s).

Both HF routers are softmax -> top-k (-> renormalize) and both sum ``w_e * down(silu(gate(x)) * up(x))`` over the
chosen experts in expert order, which is our dropless inference path. For a Llama-style decoder (see
``families.LLAMA``):

* ``MixtralForCausalLM``: MoE in every block, renormalized top-k, no query/key norms;
* ``Qwen3MoeForCausalLM``: per-head RMSNorm query/key norms (``model.qk_norm``), any dense/MoE block pattern
  (``decoder_sparse_step`` / ``mlp_only_layers``), renormalized or not (``norm_topk_prob``).

Everything else with MoE (encoders, other norms/positions, interleaved blocks without query/key norms) exports
as remote code, and so does auxiliary-loss-free balancing (``moe.balance: bias|both``): its per-expert bias
changes which experts are chosen but not their weights, so it cannot be folded into a router matrix; the
bundled modeling file holds it as the buffer ``gate.expert_bias``.
"""

from __future__ import annotations

import torch

from pretrain.config import ModelConfig, MoEConfig
from pretrain.export.families import LLAMA, Rule, StateDict, _llama_config, _llama_rules, apply_rules

MOE_KEY = ".ffn.deepspeed_moe."


def _decoder_violations(cfg: ModelConfig, family: str) -> list[str]:
    return [v.replace("Llama", family) for v in LLAMA.violations(cfg)]


def mixtral_violations(cfg: ModelConfig, moe: MoEConfig) -> list[str]:
    """Why (cfg, moe) is not exactly a Mixtral (empty: it is)."""
    out = _decoder_violations(cfg, "Mixtral")
    dense = [i for i in range(cfg.num_layers) if not moe.is_moe_layer(i)]
    if dense:
        out.append(f"blocks {dense} are dense (Mixtral has an MoE FFN in every block)")
    if not moe.renormalizes:
        out.append(
            "moe.normalize_top_k=false (Mixtral renormalizes the top-k router weights)"
            if moe.top_k > 1
            else "moe.top_k=1 weights by the chosen expert's probability (Mixtral renormalizes it to 1)"
        )
    if cfg.qk_norm:
        out.append("model.qk_norm=true (Mixtral has no query/key norms)")
    return out


def qwen3_moe_violations(cfg: ModelConfig, moe: MoEConfig) -> list[str]:
    """Why (cfg, moe) is not exactly a Qwen3-MoE (empty: it is). Qwen3-MoE always has per-head RMSNorm query/key
    norms (our ``model.qk_norm`` with RMSNorm), and takes dense blocks and un-normalized top-k."""
    out = _decoder_violations(cfg, "Qwen3-MoE")
    if not cfg.qk_norm:
        out.append("model.qk_norm=false (Qwen3-MoE always normalizes queries and keys per head)")
    return out


def moe_target(cfg: ModelConfig, moe: MoEConfig) -> tuple[str | None, list[str]]:
    """(the exact standard MoE class, []) or (None, why neither Mixtral nor Qwen3-MoE is exact)."""
    if moe.selection_bias:
        return None, [
            "moe.balance uses a selection bias (gate.expert_bias), which changes the chosen experts "
            "without entering the weights: the Mixtral and Qwen3-MoE routers cannot hold it"
        ]
    why = []
    for name, check in (("MixtralForCausalLM", mixtral_violations), ("Qwen3MoeForCausalLM", qwen3_moe_violations)):
        bad = check(cfg, moe)
        if not bad:
            return name, []
        why.append(f"{name}: {'; '.join(bad)}")
    return None, why


def _hf_config(cfg: ModelConfig, moe: MoEConfig, special: dict, target: str) -> dict:
    kw = _llama_config(cfg, special)
    dense_ffn = kw["intermediate_size"]
    for key in ("attention_bias", "mlp_bias", "head_dim"):
        kw.pop(key)
    moe_layers = sum(moe.is_moe_layer(i) for i in range(cfg.num_layers))
    kw.update(
        num_experts_per_tok=moe.top_k,
        # Ours: 1.0 per MoE layer at balance, summed over the layers; transformers' load_balancing_loss_func pools
        # every layer's router logits into one loss that is top_k at balance. Scaled so a fine-tune in transformers
        # (output_router_logits=True) balances as strongly as this run did.
        router_aux_loss_coef=moe.aux_loss_weight * moe_layers / moe.top_k,
        output_router_logits=False,
        sliding_window=None,
    )
    if target == "MixtralForCausalLM":
        kw.update(
            intermediate_size=moe.ffn_size or dense_ffn, num_local_experts=moe.num_experts, router_jitter_noise=0.0
        )
    else:
        layers = [i for i in range(cfg.num_layers) if moe.is_moe_layer(i)]
        explicit = bool(moe.layers)
        kw.update(
            intermediate_size=dense_ffn,
            moe_intermediate_size=moe.ffn_size or dense_ffn,
            num_experts=moe.num_experts,
            norm_topk_prob=moe.renormalizes,
            attention_bias=False,
            use_sliding_window=False,
            decoder_sparse_step=1 if explicit else moe.every,
            mlp_only_layers=[i for i in range(cfg.num_layers) if i not in layers] if explicit else [],
        )
    return kw


def to_hf_moe(sd: StateDict, cfg: ModelConfig, moe: MoEConfig, special: dict) -> tuple[str, dict, StateDict]:
    """(class name, HF config kwargs, HF state dict) for the exact standard MoE class of (cfg, moe). Experts are
    fused as HF stores them: ``experts.gate_up_proj`` (E, 2F, D) = [gate; up] per expert and
    ``experts.down_proj`` (E, D, F); the router is ``mlp.gate.weight``; dense blocks keep Llama's MLP names."""
    target, why = moe_target(cfg, moe)
    if target is None:
        raise ValueError(f"no standard MoE class represents this model exactly: {' | '.join(why)}")
    sd = {k[len("module.") :] if k.startswith("module.") else k: v for k, v in sd.items()}
    moe_blocks = {i for i in range(cfg.num_layers) if moe.is_moe_layer(i)}
    rules = [
        r
        for rule in _llama_rules(cfg)
        for r in rule.expand(cfg.num_layers)
        if not any(k.startswith(f"blocks.{i}.ffn.") for i in moe_blocks for k in r.ours)
    ]
    if cfg.qk_norm:
        rules += [
            Rule((f"blocks.{i}.attn.{n}_norm.weight",), f"model.layers.{i}.self_attn.{n}_norm.weight")
            for i in range(cfg.num_layers)
            for n in "qk"
        ]
    hf = apply_rules({k: v for k, v in sd.items() if MOE_KEY not in k}, rules, cfg)
    used = 0
    for i in sorted(moe_blocks):
        p, q = f"blocks.{i}{MOE_KEY}", f"model.layers.{i}.mlp."
        ex = [f"{p}experts.deepspeed_experts.{e}." for e in range(moe.num_experts)]
        hf[q + "gate.weight"] = sd[p + "gate.wg.weight"]
        hf[q + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[e + "gate_proj.weight"], sd[e + "up_proj.weight"]]) for e in ex]
        )
        hf[q + "experts.down_proj"] = torch.stack([sd[e + "down_proj.weight"] for e in ex])
        used += 1 + 3 * moe.num_experts
    left = sum(MOE_KEY in k for k in sd) - used
    if left:
        raise ValueError(f"{left} MoE weights with no place in {target}")
    return target, _hf_config(cfg, moe, special, target), hf


def remote_moe_fields(cfg: ModelConfig, moe: MoEConfig) -> dict:
    """The MoE fields of the remote-code config (``moe_layers`` resolved to block indices)."""
    if not moe.enabled:
        return {}
    return {
        "moe_num_experts": moe.num_experts,
        "moe_top_k": moe.top_k,
        "moe_ffn_size": moe.ffn_size,
        "moe_normalize_top_k": moe.renormalizes,
        "moe_selection_bias": moe.selection_bias,
        "moe_layers": [i for i in range(cfg.num_layers) if moe.is_moe_layer(i)],
    }
