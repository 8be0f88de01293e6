"""Early-exit training (LayerSkip: M. Elhoushi et al., "LayerSkip: Enabling Early Exit Inference and
Self-Speculative Decoding", ACL 2024, arXiv:2404.16710) as pure functions: which exits a step trains, their
weights, the loss of one exit through the model's shared final norm and LM head, and the most self-speculative
decoding from an exit can gain at its acceptance (:func:`speedup_bound`).

An *exit* is named by its depth E: the hidden state after the first E blocks (1 <= E < L; the full depth L is the
main loss). Exit E's weight relative to the main loss is ``scale * e(E) / e(L)`` with e(E) = 1 + 2 + ... + E
(LayerSkip's scale that grows with depth; the paper normalizes all weights, the final layer's included, to sum to
1: this objective is the paper's times the positive factor 1 / (the final layer's normalized weight), so the main
loss keeps weight 1 and ``train/loss`` is unchanged). Curricula (LayerSkip sec. 4.2): ``rotational`` trains one
exit in every R (in depth order) per step, moving by one each step; ``gradual`` switches the exits on from the
deepest down. Everything is a function of (config, depth, step): a resumed run trains the same exits as an
uninterrupted one, and after a growth the new depths join the schedule at the next step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from pretrain.config import EarlyExitConfig
from pretrain.model.score import mean_cross_entropy

Exits = list[tuple[int, float]]
"""(depth E, weight) of each exit a forward computes, in depth order."""


def exit_depths(cfg: EarlyExitConfig, num_layers: int) -> list[int]:
    """The configured exits of a model with ``num_layers`` blocks, in depth order (empty: off)."""
    if isinstance(cfg.layers, list):
        return sorted(d for d in cfg.layers if 1 <= d < num_layers)
    if cfg.layers == "all":
        return list(range(1, num_layers))
    if cfg.layers.startswith("every:"):
        n = int(cfg.layers[6:])
        return list(range(n, num_layers, n))
    return []


def exit_weight(cfg: EarlyExitConfig, depth: int, num_layers: int) -> float:
    """Exit ``depth``'s weight relative to the main loss: scale * e(E) / e(L), e(E) = E (E + 1) / 2."""
    return cfg.scale * depth * (depth + 1) / (num_layers * (num_layers + 1))


def active_exits(cfg: EarlyExitConfig, num_layers: int, step: int, max_steps: int) -> Exits:
    """The exits trained at 0-based optimizer ``step`` of a run of ``max_steps``, with their weights."""
    depths = exit_depths(cfg, num_layers)
    if cfg.curriculum == "rotational":
        depths = [d for j, d in enumerate(depths) if (j - step) % cfg.rotation == 0]
    elif cfg.curriculum == "gradual":
        done = step / max(max_steps, 1)
        depths = [d for d in depths if done >= cfg.gradual_fraction * (num_layers - d + 1) / num_layers]
    return [(d, exit_weight(cfg, d, num_layers)) for d in depths]


def validation_exits(cfg: EarlyExitConfig, num_layers: int) -> Exits:
    """Every configured exit (weight 1): what validation scores, whatever the curriculum."""
    return [(d, 1.0) for d in exit_depths(cfg, num_layers)]


def _head(model: Any, x: torch.Tensor) -> torch.Tensor:
    """The model's shared head: final norm (when it has one), head transform, LM head -> logits (B, t, V)."""
    if model.final_norm is not None:
        x = model.final_norm(x)
    if model.head_transform is not None:
        x = model.head_transform(x)
    return model.lm_head(x)


def exit_output(model: Any, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exit ``x`` (the hidden state after E blocks, this worker's slice under sequence parallelism) of a forward
    with whole-sequence ``labels``: (its mean cross-entropy, its greedy tokens or None).

    With gradients: the loss as the main loss is computed (the worker's share of the token mean under sequence
    parallelism), the head run under activation recomputation, so no exit keeps its full-vocabulary logits for
    the backward (the head runs again there, one exit at a time); tokens None. The recomputation is torch's
    non-reentrant ``checkpoint`` (its recomputed graph joins the step's own, so a weight the head shares with the
    main loss gets one gradient per backward, as ZeRO's gradient hooks expect); its first call imports
    ``torch._dynamo``, a few seconds once per worker of a run with early exits. Without gradients (validation):
    the whole sequences' loss and greedy tokens (B, T), the logits gathered under sequence parallelism."""
    sp = model.sequence_shards
    if torch.is_grad_enabled():
        if sp is None:
            return checkpoint(lambda h: model.loss(_head(model, h), labels), x, use_reentrant=False), None
        target = sp.local_targets(labels, model.causal)
        return checkpoint(lambda h: sp.cross_entropy(_head(model, h), target), x, use_reentrant=False), None
    logits = _head(model, x)
    if sp is not None:
        logits = sp.gather(logits)  # (B, T, V)
    return mean_cross_entropy(logits, labels, model.causal), logits.argmax(-1)


def with_exits(out: Any, weights: list[float], exits: list[tuple[torch.Tensor, torch.Tensor | None]]) -> Any:
    """The model output ``out`` (a ``ModelOutput``) with the exits' results (:func:`exit_output` of each, in depth
    order, weighted by ``weights``): ``exit_loss``, ``exit_losses`` and, without gradients, ``exit_tokens``."""
    losses = torch.stack([loss for loss, _ in exits])  # (E,)
    weight = torch.tensor(weights, dtype=losses.dtype, device=losses.device)
    tokens = [t for _, t in exits if t is not None]
    return out._replace(
        exit_loss=(losses * weight).sum(), exit_losses=losses, exit_tokens=torch.stack(tokens) if tokens else None
    )


def speedup_bound(acceptance: float, exit_layer: int, layers: int, max_draft: int = 64) -> dict[str, float | int]:
    """The most self-speculative greedy decoding from exit ``exit_layer`` of ``layers`` can gain over plain greedy
    when each drafted token is accepted with probability ``acceptance`` (independently; the teacher-forced
    ``val/exit_<E>/acceptance`` estimates it), whatever the implementation: time goes only into the blocks, a pass
    costs its depth whatever the number of tokens in it, and the draft's first ``exit_layer`` blocks are reused
    (LayerSkip's cache). A round drafts ``k`` tokens (``k`` passes of ``E/L``) and verifies them in one full-depth
    pass, which yields the accepted prefix plus one token: ``sum(acceptance**i for i <= k)`` tokens for
    ``1 + k E / L`` forwards. Returns the best ``k`` (1..``max_draft``) and its speed-up; below 1, drafting from
    that exit cannot pay."""
    if not 0 <= acceptance <= 1 or not 0 < exit_layer < layers:
        raise ValueError(f"acceptance {acceptance} must be in [0, 1] and the exit {exit_layer} in 1..{layers - 1}")

    def gain(k: int) -> float:
        return sum(acceptance**i for i in range(k + 1)) / (1 + k * exit_layer / layers)

    best = max(range(1, max_draft + 1), key=gain)
    return {"speedup": gain(best), "draft_tokens": best}
