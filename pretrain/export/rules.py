"""Declarative key-map rules: how one Hugging Face tensor is made from (one or more of) ours, and back.

Pure functions of (state dict, rules, config); the families in :mod:`pretrain.export.families` are lists of these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pretrain.config import ModelConfig

StateDict = dict[str, torch.Tensor]

# ----------------------------------------------------------------------------------------------
# Rules: how one HF tensor is made from (one or more of) ours, and back
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """``theirs`` (HF key) <- ``ours`` (our keys); ``{i}`` in both stands for the layer index.

    ``op``: ``copy``; ``t`` (transpose: GPT-2 Conv1D stores (in, out)); ``cat`` (concatenate ours on
    dim 0, split evenly back); ``cat_t`` (cat, then transpose). ``alias``: an extra copy written on
    export only (HF keeps the same tensor under two names). ``const``: an HF-only tensor made from the
    config (ours is empty), checked on import by the family.
    """

    ours: tuple[str, ...]
    theirs: str
    op: str = "copy"
    alias: bool = False
    const: Callable[[ModelConfig], torch.Tensor] | None = None

    def expand(self, num_layers: int) -> list[Rule]:
        if "{i}" not in self.theirs:
            return [self]
        return [
            dataclasses.replace(self, ours=tuple(k.format(i=i) for k in self.ours), theirs=self.theirs.format(i=i))
            for i in range(num_layers)
        ]


def _forward(op: str, parts: list[torch.Tensor]) -> torch.Tensor:
    if op == "copy":
        return parts[0]
    if op == "t":
        return parts[0].t().contiguous()
    if op == "cat":
        return torch.cat(parts, dim=0)
    if op == "cat_t":
        return torch.cat(parts, dim=0).t().contiguous()
    raise ValueError(f"unknown rule op {op!r}")


def _backward(op: str, tensor: torch.Tensor, n: int) -> list[torch.Tensor]:
    if op == "copy":
        return [tensor]
    if op == "t":
        return [tensor.t().contiguous()]
    if op in ("cat", "cat_t"):
        full = tensor.t() if op == "cat_t" else tensor
        if full.shape[0] % n:
            raise ValueError(f"cannot split a tensor of shape {tuple(tensor.shape)} into {n} equal parts")
        return [p.contiguous() for p in full.chunk(n, dim=0)]
    raise ValueError(f"unknown rule op {op!r}")


def apply_rules(sd: StateDict, rules: list[Rule], cfg: ModelConfig) -> StateDict:
    """Our state dict -> HF state dict. Every key of ``sd`` must be consumed (nothing silently dropped)."""
    out: StateDict = {}
    used: set[str] = set()
    for rule in (r for group in rules for r in group.expand(cfg.num_layers)):
        if rule.const is not None:
            out[rule.theirs] = rule.const(cfg)
            continue
        missing = [k for k in rule.ours if k not in sd]
        if missing:
            raise ValueError(f"state dict lacks {', '.join(missing)} (needed for {rule.theirs})")
        out[rule.theirs] = _forward(rule.op, [sd[k] for k in rule.ours])
        used.update(rule.ours)
    left = sorted(set(sd) - used)
    if left:
        raise ValueError(f"weights with no place in the target class: {', '.join(left[:6])}")
    return out


def invert_rules(hf_sd: StateDict, rules: list[Rule], cfg: ModelConfig) -> tuple[StateDict, StateDict]:
    """HF state dict -> (our state dict, the HF ``const`` tensors found, for the family to check)."""
    ours: StateDict = {}
    consts: StateDict = {}
    for rule in (r for group in rules for r in group.expand(cfg.num_layers)):
        if rule.alias:
            continue
        if rule.theirs not in hf_sd:
            # Tied output weights are not stored by save_pretrained: they are the embedding.
            if cfg.tie_embeddings and rule.ours == ("lm_head.weight",):
                continue
            raise ValueError(f"HF weights lack {rule.theirs}")
        if rule.const is not None:
            consts[rule.theirs] = hf_sd[rule.theirs]
            continue
        for key, part in zip(rule.ours, _backward(rule.op, hf_sd[rule.theirs], len(rule.ours))):
            ours[key] = part
    if cfg.tie_embeddings:
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    return ours, consts
