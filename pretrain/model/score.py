"""The one scorer: token-weighted held-out metrics of a language model, for training's validation, growth's held-back
check and ``./launch.sh eval`` alike.

:func:`score_batches` runs a forward per micro-batch and returns :class:`ScoreSums` — plain sums, so a caller
all-reduces them over ranks (:meth:`ScoreSums.as_list` / :meth:`ScoreSums.from_list`) before
:meth:`ScoreSums.metrics` turns them into numbers:

* ``loss``: mean cross-entropy in nats over the predicted tokens (decoders: positions 1..T-1 of every packed
  sequence; encoders: the masked positions), token-weighted over micro-batches: each micro-batch contributes
  its fp32 mean (:func:`mean_cross_entropy`, the model's own loss) times its token count, summed in float64;
* ``ppl``: ``exp(loss)``, the loss capped at :data:`PPL_CAP_NATS` so a diverged model's perplexity stays a
  finite, loggable number;
* ``mlm_acc`` (encoders): the fraction of masked positions whose argmax is the original token;
* ``bits_per_byte`` (decoders, when the UTF-8 bytes each token spells are known): summed nats / (ln 2 * bytes).

Single-device (no collectives): the caller decides how forwards are run (an engine under ZeRO, a plain fp32
model, a Hugging Face model) and how sums are reduced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass

import torch
import torch.nn.functional as F

PPL_CAP_NATS = 50.0
"""Perplexity is ``exp(min(loss, PPL_CAP_NATS))``: e^50 ~ 5e21, far above any model that learned anything."""
LN2 = math.log(2.0)
IGNORE = -100
"""Label of a position without a target."""

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(input_ids, labels) -> logits (B, T, V) of one micro-batch."""


class NoTokensError(ValueError):
    """The scored data has no predicted token."""


def targets(labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """The labels each logit position predicts: decoders predict token t+1 from position t."""
    return labels[:, 1:] if causal else labels


def mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """fp32 mean cross-entropy over labels != -100 (0, not NaN, without any target): the model's loss."""
    if causal:
        logits = logits[:, :-1]  # (B, T-1, V)
    flat = targets(labels, causal).reshape(-1)
    total = F.cross_entropy(logits.float().reshape(flat.numel(), -1), flat, ignore_index=IGNORE, reduction="sum")
    return total / (flat != IGNORE).sum().clamp(min=1)


@dataclass
class ScoreSums:
    """Sums over scored micro-batches; add them up over ranks before :meth:`metrics`."""

    nats: float = 0.0
    """Token-weighted cross-entropy: sum over micro-batches of (mean CE x predicted tokens)."""
    tokens: float = 0.0
    """Predicted tokens."""
    correct: float = 0.0
    """Predicted tokens whose argmax is the target (encoders)."""
    bytes: float = 0.0
    """UTF-8 bytes the predicted tokens spell (when byte counts are known)."""

    def add(
        self, logits: torch.Tensor, labels: torch.Tensor, kind: str, byte_lengths: torch.Tensor | None = None
    ) -> None:
        """One micro-batch: ``logits`` (B, T, V) of ``input_ids`` with ``labels`` (B, T)."""
        causal = kind == "decoder"
        target = targets(labels, causal)
        keep = target != IGNORE
        n = float(keep.sum())
        self.nats += mean_cross_entropy(logits, labels, causal).item() * n
        self.tokens += n
        if kind == "encoder":
            self.correct += float(((logits.argmax(-1) == target) & keep).sum())
        elif byte_lengths is not None:
            self.bytes += float(byte_lengths.to(target.device)[target[keep]].sum())

    def as_list(self) -> list[float]:
        return list(astuple(self))

    @classmethod
    def from_list(cls, values: Iterable[float]) -> ScoreSums:
        return cls(*values)

    def metrics(self, kind: str, with_bytes: bool = False, allow_empty: bool = False) -> dict[str, float]:
        """``loss``, ``ppl`` and ``mlm_acc`` (encoders) or, ``with_bytes``, ``bits_per_byte`` (decoders; NaN when
        the tokens spell no bytes). Nothing predicted raises :class:`NoTokensError`, or with ``allow_empty`` (a
        training validation that must not stop the run) scores loss 0."""
        if self.tokens == 0 and not allow_empty:
            raise NoTokensError("evaluation data has no predicted tokens")
        tokens = max(self.tokens, 1.0)
        loss = self.nats / tokens
        out = {"loss": loss, "ppl": math.exp(min(loss, PPL_CAP_NATS))}
        if kind == "encoder":
            out["mlm_acc"] = self.correct / tokens
        elif with_bytes:
            out["bits_per_byte"] = self.nats / (LN2 * self.bytes) if self.bytes else float("nan")
        return out


@torch.no_grad()
def score_batches(
    forward: Forward,
    batches: Iterable[dict[str, torch.Tensor]],
    kind: str,
    byte_lengths: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> ScoreSums:
    """The sums of ``batches`` ({"input_ids", "labels"}, labels -100 = no target), each moved to ``device``
    (when given) and run through ``forward``."""
    sums = ScoreSums()
    for mb in batches:
        ids, labels = mb["input_ids"], mb["labels"]
        if device is not None:
            ids, labels = ids.to(device), labels.to(device)
        sums.add(forward(ids, labels), labels, kind, byte_lengths)
    return sums
