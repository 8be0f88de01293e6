"""The checkpoint layer: the layout of a run directory and a checkpoint (``layout``), the typed manifest
(``manifest``), the commit protocol, discovery, verification and pruning (``store``), the collective writer
(``writer``) and its asynchronous half (``snapshot``: host copy, background write), the reader (``reader``) and
the model-state formats (``weights``). Imported by ``pretrain.train``, ``cluster`` and ``pretrain.export``; it
imports none of them (``.importlinter``)."""

from pretrain.checkpoint.manifest import FORMAT_DEEPSPEED, FORMAT_FULL, Manifest
from pretrain.checkpoint.store import (
    CheckpointError,
    CommittedCheckpoint,
    cleanup_staging,
    latest_committed,
    list_committed,
    open_committed,
    read_manifest,
    resolve,
    verify,
    verify_or_point_back,
)

__all__ = [
    "FORMAT_DEEPSPEED",
    "FORMAT_FULL",
    "CheckpointError",
    "CommittedCheckpoint",
    "Manifest",
    "cleanup_staging",
    "latest_committed",
    "list_committed",
    "open_committed",
    "read_manifest",
    "resolve",
    "verify",
    "verify_or_point_back",
]
