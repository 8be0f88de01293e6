"""The driver's stop signals (``pretrain/driver/signals.py``): the first asks the run to stop with a checkpoint; one
that cannot be asked (the request cannot be written) stops at once, never a crash somewhere in the loop. Signals
sent to real runs: ``tests/integration/train/test_stop.py``."""

from __future__ import annotations

import signal

import pytest

from pretrain.driver.signals import StopNow, StopSignals
from pretrain.train.stop_request import read_request


def test_the_first_signal_asks_and_one_that_cannot_ask_stops_at_once(tmp_path):
    with StopSignals(tmp_path, timeout_s=60) as stops:
        stops._handle(signal.SIGTERM, None)
        assert read_request(tmp_path)["signal"] == "SIGTERM" and stops.signame == "SIGTERM"
        with pytest.raises(StopNow, match="SIGINT again: stopping at once"):
            stops._handle(signal.SIGINT, None)
    assert read_request(tmp_path) is None  # gone on the way out
    gone = tmp_path / "removed" / "run"  # (a run directory that cannot take the request)
    with StopSignals(gone, timeout_s=60) as stops, pytest.raises(StopNow) as e:
        stops._handle(signal.SIGINT, None)
    assert str(e.value).startswith("SIGINT: cannot ask the run to stop (") and e.value.signum == signal.SIGINT
