"""Tests use the library's real-process launcher (see ``pretrain/train/procs.py``)."""

from pretrain.train.procs import run_distributed

__all__ = ["run_distributed"]
