"""Python's cyclic garbage collector paused while a training process starts up, to shorten its time to first step.

Start-up builds about 1.2 million long-lived Python objects (the modules of torch, DeepSpeed, transformers, MLflow
and SQLAlchemy; the config, the tokenizer, the model and its engine) and little garbage. With automatic collection
on, every full collection scans all of them again: for the demo decoder, several full collections and over a
thousand young ones before its first step (counted with ``gc.callbacks``). Paused, the same objects are scanned
once, by one full collection when the first step has ended, after which automatic collection resumes with all of
them in the oldest generation, where it rarely looks. ``time_to_first_step_s`` (``./launch.sh bench``) measures the
start-up; results are in ``benchmarks/results/``.

The collection is not skipped (``gc.freeze`` would skip it): what start-up leaves unreachable (41,000 objects in the
demo, none of them tensors) is freed, and objects that live at the first step stay collectable later (a growth's
old engine, whose modules and hooks form cycles, must be freed when it is replaced). torchtitan and OLMo-core go
further and turn automatic collection off for the whole run, collecting every N steps; that is not done here.

Only process entries pause (``python -m pretrain train|resume``, a Ray worker's training function); library use
(tests, notebooks) never does, so :func:`resume` is a no-op there. A process that was started with collection
disabled stays so.
"""

from __future__ import annotations

import gc

_state = {"paused": False}


def pause() -> None:
    """Stop automatic collection until :func:`resume` (only if it is on)."""
    if gc.isenabled():
        gc.disable()
        _state["paused"] = True


def resume() -> None:
    """After :func:`pause`: one full collection, then automatic collection on again; otherwise nothing."""
    if _state["paused"]:
        _state["paused"] = False
        gc.collect()
        gc.enable()


def paused() -> bool:
    """Whether :func:`pause` is in effect."""
    return _state["paused"]
