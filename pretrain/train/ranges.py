"""Named ranges of the training loop for the torch profiler (``train.profile_at``): the batch fetch, the step
and every callback's event handler (``loop/next_batch``, ``loop/run_step``, ``loop/MetricsLogger.on_step_end``,
...), so a profile shows where the loop's time goes beyond the step's operators. Free when no profiler runs."""

from __future__ import annotations

import contextlib

import torch

PREFIX = "loop/"


def loop_range(name: str):
    """A ``record_function`` range ``loop/<name>`` while a profiler records, else a no-op context."""
    if torch.autograd._profiler_enabled():  # a flag check; a record_function has a cost even without a profiler
        return torch.profiler.record_function(PREFIX + name)
    return contextlib.nullcontext()
