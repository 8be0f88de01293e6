"""Layer dropout as pure functions: the rate schedule, the per-step decisions and the gates the model applies.

A *gate* multiplies one residual branch (attention or FFN sub-layer) of one block (see ``Block.forward``):
``None`` runs it unchanged, ``0.0`` skips it (no forward and no backward work), another float scales its output,
and a (B,) tensor scales it per sample (stochastic depth: the branch runs, dropped samples get 0).

Decisions are functions of (seed, step, layer, sub-layer[, global micro-batch id]) only: a private generator seeded
from their hash, so every rank computes the same gates with no communication, a resumed run the same as an
uninterrupted one, and a worker count change moves no ``layer``-mode decision; ``sample``-mode gates (per global
micro-batch) stay where the micro-batch ids do not depend on it (:meth:`pretrain.config.plan.RunPlan.micro_batch_ids`).

Sources: layer dropout and its inference scaling, z^l = rho * LNorm(F^l(z^(l-1))) + z^(l-1) with rho the keep
probability of the sub-layer: T. Xiao and J. Zhu, "Introduction to Transformers: an NLP Perspective"
(arXiv:2311.17633), sec. 4.2.4, eq. 95. ``layer`` mode: LayerDrop (Fan et al. 2019, arXiv:1909.11556); ``sample``
mode and the depth-linear rates of ``by_depth: linear``: stochastic depth (Huang et al. 2016, arXiv:1603.09382);
``schedule: progressive``: Progressive Layer Dropping (Zhang and He 2020, arXiv:2010.13369).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence

import torch

from pretrain.config import LayerDropConfig
from pretrain.model.layers import skips

Gate = float | torch.Tensor | None
Gates = list[tuple[Gate, Gate]]  # per block: (attention gate, FFN gate)


def base_rate(cfg: LayerDropConfig, step: int) -> float:
    """The schedule's drop rate at 0-based optimizer ``step`` (before the depth factor)."""
    if cfg.schedule == "linear":
        return cfg.rate * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else cfg.rate
    if cfg.schedule == "progressive":  # PLD: keep theta(t) = (1 - theta_bar) exp(-gamma t) + theta_bar
        theta_bar = 1.0 - cfg.rate
        return 1.0 - ((1.0 - theta_bar) * math.exp(-cfg.gamma * step) + theta_bar)
    return cfg.rate


def as_of(cfg: LayerDropConfig, step: int) -> LayerDropConfig:
    """``cfg`` with its schedule's rate at 0-based optimizer ``step`` as a constant rate: the layer dropout the
    weights were trained under when ``step + 1`` steps were done, which is what a model saved then is scaled by at
    inference (``rho``) and what a growth or a pruning of it folds (a ``linear`` or ``progressive`` schedule that
    has not reached ``rate`` yet: a lower rate than the final one)."""
    if cfg.schedule == "constant":
        return cfg
    return dataclasses.replace(cfg, rate=base_rate(cfg, max(step, 0)), schedule="constant")


def layer_rates(cfg: LayerDropConfig, num_layers: int, rate: float) -> list[float]:
    """Drop rate per block for a schedule rate ``rate``: uniform, or growing linearly with depth."""
    if cfg.by_depth == "linear":
        return [rate * (i + 1) / num_layers for i in range(num_layers)]
    return [rate] * num_layers


def _uniform(*key: object, n: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(":".join(map(str, key)).encode()) & 0x7FFFFFFF)
    return torch.rand(n, generator=g, dtype=torch.float64)


def keep_decisions(cfg: LayerDropConfig, seed: int, step: int, num_layers: int) -> list[tuple[bool, bool]]:
    """``layer`` mode: whether each block's (attention, FFN) sub-layer runs at ``step`` (same for the batch)."""
    rates = layer_rates(cfg, num_layers, base_rate(cfg, step))
    out = []
    for i, r in enumerate(rates):
        u = _uniform("layerdrop", seed, step, i, n=2).tolist()
        attn = u[0] >= r
        ffn = attn if cfg.granularity == "block" else u[1] >= r
        out.append((attn, ffn))
    return out


def training_gates(
    cfg: LayerDropConfig, seed: int, step: int, num_layers: int, micro_id: int | None = None, batch_size: int = 0
) -> Gates:
    """The gates of one training forward at 0-based ``step``. ``sample`` mode draws per sample of the micro-batch
    with global id ``micro_id`` (``batch_size`` samples). ``inverted`` scaling divides kept branches by rho."""
    rates = layer_rates(cfg, num_layers, base_rate(cfg, step))
    inverted = cfg.scaling == "inverted"
    gates: Gates = []
    if cfg.mode == "layer":
        for (attn, ffn), r in zip(keep_decisions(cfg, seed, step, num_layers), rates):
            kept = (1.0 / (1.0 - r)) if inverted and r > 0 else None
            gates.append((kept if attn else 0.0, kept if ffn else 0.0))
        return gates
    for i, r in enumerate(rates):
        if r <= 0:
            gates.append((None, None))
            continue
        u = _uniform("stochdepth", seed, step, micro_id, i, n=2 * batch_size).view(2, batch_size)
        if cfg.granularity == "block":
            u = u[:1].expand(2, batch_size)
        keep = (u >= r).float()  # (2, B)
        if inverted:
            keep = keep / (1.0 - r)
        gates.append((keep[0], keep[1]))
    return gates


def inference_scales(
    cfg: LayerDropConfig, num_layers: int, step: int | None = None
) -> list[tuple[float, float]] | None:
    """``rho`` scaling: each sub-layer's output times rho = 1 - its drop rate at inference (Xiao and Zhu, eq. 95;
    see the module docstring): with ``step`` the schedule's rate at that 0-based step (the keep probability
    1 - r(t) the weights are trained under: validation, and a checkpoint's export, prune, growth and ``eval``
    through :func:`as_of` its last step), else ``cfg.rate``. None when nothing is scaled (``inverted``, or no
    layer dropout)."""
    if step is not None:
        cfg = as_of(cfg, step)
    if not cfg.enabled or cfg.scaling != "rho":
        return None
    return [(1.0 - r, 1.0 - r) for r in layer_rates(cfg, num_layers, cfg.rate)]


def executed_blocks(gates: Gates) -> list[int]:
    """Indices of the blocks with at least one sub-layer that runs."""
    return [i for i, (a, f) in enumerate(gates) if not (skips(a) and skips(f))]


def select_blocks(spec: str | Sequence[int], num_layers: int) -> list[int]:
    """Blocks a pruned model keeps: ``every_other`` (0, 2, 4, ...), ``first:N``, or a list of indices."""
    if isinstance(spec, str):
        if spec == "every_other":
            return list(range(0, num_layers, 2))
        if spec.startswith("first:") and spec[6:].isdigit():
            n = int(spec[6:])
            if not 0 < n <= num_layers:
                raise ValueError(f"first:{n}: the model has {num_layers} blocks")
            return list(range(n))
        spec = [int(x) for x in spec.replace("[", "").replace("]", "").split(",") if x.strip()]
    keep = sorted(set(int(i) for i in spec))
    if not keep or keep[0] < 0 or keep[-1] >= num_layers:
        raise ValueError(f"blocks {keep}: the model has blocks 0..{num_layers - 1}")
    return keep


def fold_branch_scales(
    state: dict[str, torch.Tensor], placement: str, scales: Sequence[tuple[float, float]]
) -> dict[str, torch.Tensor]:
    """A state dict whose plain forward equals the model with ``branch_scales`` (rho of Xiao and Zhu's eq. 95 at
    inference, see the module docstring): each sub-layer's last linear map (``o_proj``, ``down_proj`` of the FFN or
    of every expert; the output norm of a ``sandwich`` block) is multiplied by its scale, biases included. Standard
    classes then load it as is."""
    out = dict(state)
    for i, (attn, ffn) in enumerate(scales):
        for scale, last in (
            (attn, ("attn.o_proj.",) if placement != "sandwich" else ("norm_out1.",)),
            (ffn, (".down_proj.",) if placement != "sandwich" else ("norm_out2.",)),
        ):
            if scale == 1.0:
                continue
            prefix = f"blocks.{i}."
            for key in state:
                if key.startswith(prefix) and any(m in key[len(prefix) - 1 :] for m in last):
                    out[key] = state[key] * scale
    return out
