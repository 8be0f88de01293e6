"""Mixture-of-Experts export: the exact Mixtral map, remote-code fields, and consolidation of expert-parallel
checkpoints (pure functions of config and state dict, except :func:`expert_parallel_state_dict`, which reads
DeepSpeed's files).

``MixtralForCausalLM`` is exact for a Llama-style decoder (see ``families.LLAMA``) whose every block is MoE with
renormalized top-k routing: Mixtral's router is fp32 softmax -> top-k -> renormalize, and its experts sum
``w_e * down(silu(gate(x)) * up(x))`` in expert order, which is our dropless inference path. Everything else
with MoE (encoders, interleaved dense/MoE blocks, un-normalized top-k, other norms) exports as remote code.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pretrain.config import ModelConfig, MoEConfig
from pretrain.export.families import LLAMA, StateDict, _llama_config, _llama_rules, apply_rules

MOE_KEY = ".ffn.deepspeed_moe."
_EXPERT = re.compile(r"^(blocks\.\d+\.ffn\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..+)$")


def mixtral_violations(cfg: ModelConfig, moe: MoEConfig) -> list[str]:
    """Why (cfg, moe) is not exactly a Mixtral (empty: it is)."""
    out = [v.replace("Llama", "Mixtral") for v in LLAMA.violations(cfg)]
    dense = [i for i in range(cfg.num_layers) if not moe.is_moe_layer(i)]
    if dense:
        out.append(f"blocks {dense} are dense (Mixtral has an MoE FFN in every block)")
    if not moe.normalize_top_k:
        out.append("moe.normalize_top_k=false (Mixtral renormalizes the top-k router weights)")
    return out


def mixtral_config(cfg: ModelConfig, moe: MoEConfig, special: dict) -> dict:
    kw = _llama_config(cfg, special)
    for key in ("attention_bias", "mlp_bias"):
        kw.pop(key)
    kw.update(intermediate_size=moe.ffn_size or kw["intermediate_size"], num_local_experts=moe.num_experts,
              num_experts_per_tok=moe.top_k, router_jitter_noise=0.0, sliding_window=None,
              router_aux_loss_coef=moe.aux_loss_weight, output_router_logits=False)
    return kw


def to_mixtral(sd: StateDict, cfg: ModelConfig, moe: MoEConfig, special: dict) -> tuple[dict, StateDict]:
    """(MixtralConfig kwargs, Mixtral state dict). Experts are fused as HF stores them:
    ``experts.gate_up_proj`` (E, 2F, D) = [gate; up] per expert and ``experts.down_proj`` (E, D, F)."""
    bad = mixtral_violations(cfg, moe)
    if bad:
        raise ValueError(f"MixtralForCausalLM cannot represent this model exactly: {'; '.join(bad)}")
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    dense = {k: v for k, v in sd.items() if MOE_KEY not in k}
    rules = [r for r in _llama_rules(cfg) if ".ffn." not in r.ours[0]]
    hf = apply_rules(dense, rules, cfg)
    used = 0
    for i in range(cfg.num_layers):
        p, q = f"blocks.{i}{MOE_KEY}", f"model.layers.{i}.mlp."
        ex = [f"{p}experts.deepspeed_experts.{e}." for e in range(moe.num_experts)]
        hf[q + "gate.weight"] = sd[p + "gate.wg.weight"]
        hf[q + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[e + "gate_proj.weight"], sd[e + "up_proj.weight"]]) for e in ex])
        hf[q + "experts.down_proj"] = torch.stack([sd[e + "down_proj.weight"] for e in ex])
        used += 1 + 3 * moe.num_experts
    left = sum(MOE_KEY in k for k in sd) - used
    if left:
        raise ValueError(f"{left} MoE weights with no place in MixtralForCausalLM")
    return mixtral_config(cfg, moe, special), hf


def remote_moe_fields(cfg: ModelConfig, moe: MoEConfig) -> dict:
    """The MoE fields of the remote-code config (``moe_layers`` resolved to block indices)."""
    if not moe.enabled:
        return {}
    return {"moe_num_experts": moe.num_experts, "moe_top_k": moe.top_k, "moe_ffn_size": moe.ffn_size,
            "moe_normalize_top_k": moe.normalize_top_k,
            "moe_layers": [i for i in range(cfg.num_layers) if moe.is_moe_layer(i)]}


def expert_parallel_state_dict(ds_tag_dir: Path) -> StateDict:
    """Full state dict of an expert-parallel DeepSpeed checkpoint: the module state of rank 0 (dense weights)
    plus DeepSpeed's one file per expert (``layer_{l}_expert_{e}_mp_rank_00_model_states.pt``, keys already
    carrying the global expert id). Values are the module weights in the training dtype (exact fp32 for fp32
    runs); DeepSpeed's ``zero_to_fp32`` does not understand expert-partitioned optimizer state."""
    main = sorted(ds_tag_dir.glob("mp_rank_*_model_states.pt"))
    if not main:
        raise FileNotFoundError(f"no DeepSpeed model state in {ds_tag_dir}")
    sd = dict(torch.load(main[0], map_location="cpu", weights_only=True)["module"])
    files = sorted(ds_tag_dir.glob("layer_*_expert_*_mp_rank_*_model_states.pt"))
    if not files:
        raise FileNotFoundError(f"no per-expert files (layer_*_expert_*) in {ds_tag_dir}")
    for f in files:
        for key, value in torch.load(f, map_location="cpu", weights_only=True).items():
            sd[key] = value
    return sd


def check_experts_complete(sd: StateDict, cfg: ModelConfig, moe: MoEConfig) -> None:
    """Every MoE block has experts 0..E-1 (guards consolidation of a partial checkpoint)."""
    seen: dict[str, set[int]] = {}
    for key in sd:
        m = _EXPERT.match(key[len("module."):] if key.startswith("module.") else key)
        if m:
            seen.setdefault(m.group(1), set()).add(int(m.group(2)))
    for i in range(cfg.num_layers):
        if moe.is_moe_layer(i):
            got = seen.get(f"blocks.{i}{MOE_KEY}experts.deepspeed_experts.", set())
            if got != set(range(moe.num_experts)):
                raise ValueError(f"block {i}: experts {sorted(got)} in the checkpoint, expected 0..{moe.num_experts - 1}")
