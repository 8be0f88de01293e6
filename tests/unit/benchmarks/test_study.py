"""The study arithmetic of ``bench --growth`` / ``--layer-drop --quality`` on known curves
(``benchmarks/study.py``)."""

from __future__ import annotations

import pytest

from benchmarks.curves import ahead_from, crossing, flops_saving, mean_curve, time_to_loss_speedup, value_at

SCRATCH = [(1.0, 5.0), (2.0, 4.0), (3.0, 3.5), (4.0, 3.0)]


def test_saving_from_known_curves():
    grown = [(1.0, 4.5), (2.0, 3.2), (3.0, 2.9), (4.0, 2.8)]
    assert crossing(grown, 3.0) == pytest.approx(2.0 + (3.2 - 3.0) / (3.2 - 2.9))  # interpolated between 2 and 3
    assert flops_saving(SCRATCH, grown) == pytest.approx(1 - (2.0 + 0.2 / 0.3) / 4.0)
    assert flops_saving(SCRATCH, SCRATCH) == 0.0
    assert flops_saving(SCRATCH, [(1.0, 6.0), (4.0, 3.1)]) is None, "never reaches the scratch loss"
    assert flops_saving(SCRATCH, [(2.0, 2.0)]) == 0.5, "already there at its first point"
    assert time_to_loss_speedup(SCRATCH, [(1.0, 4.0), (2.0, 3.0)]) == 2.0
    assert time_to_loss_speedup(SCRATCH, [(8.0, 3.0)]) == 0.5


def test_interpolation_and_ahead_from():
    assert value_at(SCRATCH, 2.5) == pytest.approx(3.75)
    assert value_at(SCRATCH, 0.0) == 5.0 and value_at(SCRATCH, 9.0) == 3.0
    small = [(1.0, 4.0), (2.0, 3.8), (3.0, 3.7), (4.0, 3.65)]
    assert ahead_from(SCRATCH, small) == 3.0, "the larger model is ahead from x = 3"
    assert ahead_from(small, [(1.0, 1.0), (4.0, 1.0)]) is None
    back = [(1.0, 4.0), (2.0, 4.1), (3.0, 3.3), (4.0, 3.2)]  # scratch below at 2, above at 3, below for good at 4
    assert ahead_from(SCRATCH, back) == 4.0, "a dip below that does not last is not ahead"
    assert ahead_from(SCRATCH, [(1.0, 9.0), (4.0, 9.0)]) == 1.0, "ahead throughout"


def test_mean_curve_over_seeds():
    other = [(1.0, 4.0), (2.0, 3.0), (4.0, 2.0)]  # no point at 3: interpolated there (2.5)
    assert mean_curve([SCRATCH, other]) == [(1.0, 4.5), (2.0, 3.5), (3.0, 3.0), (4.0, 2.5)]
    assert mean_curve([SCRATCH]) == SCRATCH
