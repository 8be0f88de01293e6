"""The fingerprint of the run's data sources in every checkpoint, where a resume compares the sources with it."""

from __future__ import annotations

from typing import Any

from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.speed import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.job import FINGERPRINT_STATE


class DataFingerprint(Callback):
    """Keeps the job's data fingerprint (taken by the driver: :mod:`pretrain.data.fingerprint`) in the trainer
    state of every checkpoint. A resumed run keeps the fingerprint of the data it resumed on, not the saved one."""

    order = 100  # the default: it only answers state_dict, whenever a checkpoint is written
    name = FINGERPRINT_STATE

    def __init__(self, fingerprint: dict[str, Any]) -> None:
        self.fingerprint = fingerprint

    def state_dict(self) -> dict[str, Any] | None:
        return self.fingerprint or None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved fingerprint was checked by the driver; this run records the sources as they are now."""
