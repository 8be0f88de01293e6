"""The job a driver hands to its workers: plain data, in a module of its own so that the driver does not import
the worker's training stack (torch, DeepSpeed, transformers) to build one."""

from __future__ import annotations

from dataclasses import dataclass, field

FINGERPRINT_STATE = "data_fingerprint"
"""The key of the data fingerprint in a checkpoint's trainer state (``callbacks``)."""


@dataclass(kw_only=True)
class Job:
    """Everything a worker needs; plain data so it travels to Ray workers."""

    config: dict
    """The resolved config (``to_dict(RunConfig)``)."""
    run_id: str
    """MLflow run id (or a local id when tracking is disabled)."""
    run_dir: str
    """Absolute checkpoint directory of this run."""
    tracking_uri: str = ""
    """MLflow tracking URI; empty disables tracking."""
    init_weights: str = ""
    """A full model state dict (``torch.save``, loaded with ``weights_only``) to start from instead of the seeded
    init, e.g. converted from ``model.init_from_hf`` by the driver; a resumed checkpoint overrides it."""
    startup: list = field(default_factory=list)
    """The driver's start-up marks (:func:`pretrain.timeline.marks`), continued by the worker up to its first
    step; empty when the job was not started by a command (the worker's timeline then starts at its setup)."""
    data_fingerprint: dict = field(default_factory=dict)
    """The fingerprint of the data sources the job trains on (:mod:`pretrain.data.fingerprint`), taken by the driver;
    every checkpoint keeps it, and a resume compares the sources with it."""
