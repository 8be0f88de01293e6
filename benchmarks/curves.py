"""The arithmetic that turns validation curves into a study's readings: where a curve reaches a loss, where one
curve stays ahead of another, the FLOPs saved and the speed-up to a loss, the mean over seeds."""

from __future__ import annotations

Curve = list[tuple[float, float]]
"""(x, validation loss) points in training order; x is FLOPs or seconds."""


def crossing(curve: Curve, target: float) -> float | None:
    """The first x at which ``curve`` reaches ``target`` (loss <= target), linearly interpolated between the two
    points around it; None when it never does."""
    prev = None
    for x, loss in curve:
        if loss <= target:
            if prev is None:
                return x
            x0, l0 = prev
            return x0 + (x - x0) * (l0 - target) / (l0 - loss)
        prev = (x, loss)
    return None


def value_at(curve: Curve, x: float) -> float:
    """``curve``'s loss at ``x``, linearly interpolated (held flat outside the curve)."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, l0), (x1, l1) in zip(curve, curve[1:]):
        if x <= x1:
            return l0 + (l1 - l0) * (x - x0) / (x1 - x0) if x1 != x0 else l1
    return curve[-1][1]


def mean_curve(curves: list[Curve]) -> Curve:
    """The mean of ``curves`` (one run type over seeds) at the first curve's x, each other curve interpolated there
    (:func:`value_at`): a view of the run type less sensitive to one seed's late swings than any single curve."""
    return [(x, sum(value_at(c, x) for c in curves) / len(curves)) for x, _ in curves[0]]


def ahead_from(curve: Curve, other: Curve) -> float | None:
    """The x of ``curve`` from which its loss stays at or below ``other``'s (interpolated) to its end: the point after
    the last one where it is above (a curve that dips below and comes back up is not ahead yet); None: it ends
    above."""
    above = [i for i, (x, loss) in enumerate(curve) if loss > value_at(other, x)]
    if not above:
        return curve[0][0]
    return None if above[-1] == len(curve) - 1 else curve[above[-1] + 1][0]


def flops_saving(reference: Curve, other: Curve) -> float | None:
    """1 - (x at which ``other`` first reaches ``reference``'s final loss) / (``reference``'s final x): the share of
    the reference's FLOPs that ``other`` does not need for the same loss (negative: it needs more; None: never)."""
    hit = crossing(other, reference[-1][1])
    return None if hit is None else 1.0 - hit / reference[-1][0]


def time_to_loss_speedup(reference: Curve, other: Curve) -> float | None:
    """``reference``'s final x over the x at which ``other`` first reaches ``reference``'s final loss (> 1: faster);
    None when ``other`` never gets there."""
    hit = crossing(other, reference[-1][1])
    return None if hit is None else reference[-1][0] / hit
