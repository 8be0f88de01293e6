"""The run picture's early-exit panel: which series it draws and that it is drawn (the stability panels are tested
with the monitor, ``tests/unit/train/stability/test_monitor.py``)."""

from __future__ import annotations

import struct

from pretrain.train.plot import exit_keys, plot_training


def _png_height(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", data[20:24])[0]


def test_exit_series_are_found_by_depth_and_drawn_in_a_third_panel(tmp_path):
    names = [
        "val/loss",
        "val/exit_10/loss",
        "val/exit_2/acceptance",
        "val/exit_2/loss",
        "val/exit_x/loss",
        "train/loss",
    ]
    assert exit_keys(names) == ("val/exit_2/acceptance", "val/exit_2/loss", "val/exit_10/loss")
    base = {
        "train/loss": [(s, 3 - 0.01 * s) for s in range(1, 20)],
        "train/grad_norm": [(s, 1.0) for s in range(1, 20)],
        "val/loss": [(10, 2.9), (19, 2.8)],
    }
    exits = {
        "val/exit_1/loss": [(10, 3.4), (19, 3.2)],
        "val/exit_1/acceptance": [(10, 0.3), (19, 0.4)],
        "val/exit_2/loss": [(10, 3.1), (19, 3.0)],
        "val/exit_2/acceptance": [(10, 0.6), (19, 0.7)],
    }
    plain = plot_training(base, [], tmp_path / "plain.png")
    with_exits = plot_training({**base, **exits}, [], tmp_path / "exits.png")
    assert _png_height(with_exits) > _png_height(plain) * 1.2  # the early-exit panel below the two others
