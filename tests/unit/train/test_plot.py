"""The run picture: the early-exit panel (which series it draws, and that it is drawn) and the stability timeline
read from MLflow (the stability panels are tested with the monitor, ``tests/unit/train/stability/test_monitor.py``)."""

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


def test_the_timeline_is_read_from_mlflow_without_leaving_a_temporary_directory(tmp_path, monkeypatch):
    import tempfile

    from mlflow import MlflowClient

    from pretrain.train.plot import timeline_from_mlflow
    from tests.empty_store import empty_store

    uri = f"sqlite:///{empty_store(tmp_path / 'store')}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("plot", artifact_location=(tmp_path / "artifacts").as_uri())
    with_events, without = (client.create_run(exp).info.run_id for _ in range(2))
    events = [{"step": 7, "kind": "spike", "action": "skip"}]
    client.log_dict(with_events, {"timeline": events}, "stability/timeline.json")

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where MLflow and the reader put temporary files
    assert timeline_from_mlflow(uri, with_events) == events
    assert timeline_from_mlflow(uri, without) == []
    assert list(scratch.iterdir()) == []
