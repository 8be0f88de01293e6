"""Import of a Hugging Face directory of a supported family into our config fields and state dict
(``model.init_from_hf``, eval of an HF directory); the inverse of :mod:`pretrain.export.hf`'s export,
bitwise lossless for export -> import -> export."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from pretrain.config import ModelConfig, to_dict
from pretrain.export.families import FAMILIES, FAMILY_BY_MODEL_TYPE, Family, StateDict, invert_rules
from pretrain.model.transformer import Transformer

REMOTE_MODEL_TYPE = "pretrain_transformer"  # our own trust_remote_code exports (pretrain/export/remote_code)


def read_hf_state_dict(hf_dir: Path) -> StateDict:
    """All tensors of an HF directory: (sharded) safetensors, else (sharded) ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: StateDict = {}
        for f in files:
            out.update(load_file(str(hf_dir / f)))
        return out
    if (hf_dir / "model.safetensors").is_file():
        return load_file(str(hf_dir / "model.safetensors"))
    bins = sorted(hf_dir.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for f in bins:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    raise ValueError(f"{hf_dir}: no model.safetensors[.index.json] or pytorch_model.bin")


def _normalize_hf_keys(hf_sd: StateDict, family: Family) -> StateDict:
    """Old BERT checkpoints name LayerNorm parameters gamma/beta; base-model checkpoints lack the prefix."""
    out = {}
    for k, v in hf_sd.items():
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[k] = v
    prefix = {"llama": "model.", "gpt2": "transformer.", "bert": "bert."}[family.name]
    if not any(k.startswith(prefix) for k in out):
        out = {(k if k.startswith(("lm_head.", "cls.")) else prefix + k): v for k, v in out.items()}
    return out


def _complete_biases(sd: StateDict, cfg: ModelConfig) -> tuple[StateDict, ModelConfig]:
    """All-zero biases -> ``bias=False`` (dropped); otherwise ``bias=True`` and missing biases are zeros."""
    biases = [k for k in sd if k.endswith(".bias")]
    if biases and all(not torch.any(sd[k] != 0) for k in biases):
        return {k: v for k, v in sd.items() if not k.endswith(".bias")}, dataclasses.replace(cfg, bias=False)
    if not biases:
        return sd, dataclasses.replace(cfg, bias=False)
    cfg = dataclasses.replace(cfg, bias=True)
    with torch.device("meta"):
        expected = Transformer(cfg).state_dict()
    out = dict(sd)
    for k, v in expected.items():
        if k not in out and k.endswith(".bias"):
            out[k] = torch.zeros(v.shape, dtype=torch.float32)  # e.g. GPT-2's bias-free LM head
    return out, cfg


def import_hf(hf_dir: str | Path, max_seq_len: int | None = None) -> tuple[dict[str, Any], StateDict]:
    """(our ModelConfig fields, our state dict) from an HF directory of a supported family.

    Supported: ``llama`` (LlamaForCausalLM), ``gpt2`` (GPT2LMHeadModel, exact-GELU only), ``bert``
    (BertForMaskedLM), and our own ``pretrain_transformer`` remote-code exports. ``max_seq_len`` (e.g.
    the run's sequence length) replaces the HF maximum: rotary models just take it, learned position
    tables keep their first ``max_seq_len`` rows. Raises ValueError for anything not exactly
    representable.
    """
    hf_dir = Path(hf_dir).expanduser()
    cfg_file = hf_dir / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{hf_dir}: not a Hugging Face model directory (no config.json)")
    hf = json.loads(cfg_file.read_text())
    model_type = hf.get("model_type")
    if model_type == "mixtral" or hf.get("moe_num_experts"):
        raise ValueError(
            f"{hf_dir}: importing Mixture-of-Experts models (model.init_from_hf, eval of an HF "
            f"directory through our model) is not supported; export and eval of MoE checkpoints are"
        )
    hf_sd = read_hf_state_dict(hf_dir)
    if model_type == REMOTE_MODEL_TYPE:
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        cfg = ModelConfig(**{k: v for k, v in hf.items() if k in fields and k != "init_from_hf"})
        sd = {k: v for k, v in hf_sd.items()}
        if cfg.tie_embeddings:
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
    else:
        family = FAMILY_BY_MODEL_TYPE.get(model_type)
        if family is None:
            known = ", ".join([f.model_type for f in FAMILIES] + [REMOTE_MODEL_TYPE])
            raise ValueError(f"{hf_dir}: model_type {model_type!r} is not supported for import (supported: {known})")
        cfg = ModelConfig(**family.config_from_hf(hf))
        sd, consts = invert_rules(_normalize_hf_keys(hf_sd, family), family.rules(cfg), cfg)
        sd = family.absorb_consts(sd, consts)
        sd, cfg = _complete_biases(sd, cfg)
    if max_seq_len is not None and max_seq_len != cfg.max_seq_len:
        if cfg.position == "learned":
            if max_seq_len > cfg.max_seq_len:
                raise ValueError(
                    f"max_seq_len {max_seq_len} exceeds the {cfg.max_seq_len} learned positions of {hf_dir}"
                )
            sd["embed_positions.weight"] = sd["embed_positions.weight"][:max_seq_len].contiguous()
        cfg = dataclasses.replace(cfg, max_seq_len=max_seq_len)
    cfg = dataclasses.replace(cfg, vocab_multiple=1)
    with torch.device("meta"):
        expected = set(Transformer(cfg).state_dict())
    if set(sd) != expected:
        raise ValueError(
            f"{hf_dir}: weights do not match the architecture (missing {sorted(expected - set(sd))[:5]}, "
            f"unexpected {sorted(set(sd) - expected)[:5]})"
        )
    return to_dict(cfg), {k: v.to(torch.float32).contiguous() for k, v in sd.items()}


def model_config_from_hf(
    hf_dir: str | Path, base: ModelConfig, max_seq_len: int | None = None
) -> tuple[ModelConfig, StateDict]:
    """For ``model.init_from_hf``: the architecture of ``hf_dir`` with the training choices of ``base``
    (dropout, attention_dropout, init_std, z_loss, init_from_hf) and its weights."""
    fields, sd = import_hf(hf_dir, max_seq_len=max_seq_len)
    keep = {k: getattr(base, k) for k in ("dropout", "attention_dropout", "init_std", "z_loss", "init_from_hf")}
    return ModelConfig(**{**fields, **keep}), sd
