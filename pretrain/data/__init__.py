"""Data pipeline: sources and mixtures, tokenizer, virtual streams, packing, MLM masking, validation.

See :mod:`pretrain.data.stream` (mixtures, holdout, virtual streams), :mod:`pretrain.data.packing`
(packing and masking), :mod:`pretrain.data.batches` (steps, exact and elastic resume) and
:mod:`pretrain.data.sanity` (the driver's corpus checks before anything starts).

The names below are imported lazily (PEP 562), so that ``pretrain.data.sanity`` and
``pretrain.data.sources`` can run on the driver without importing torch, transformers or datasets
(a config or corpus error is then refused within a second or two of the command).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "cached_unigram_baseline_loss": "baseline",
    "unigram_baseline_loss": "baseline",
    "TrainBatches": "batches",
    "data_throughput": "batches",
    "merge_states": "batches",
    "validation_batches": "batches",
    "validation_sequences": "batches",
    "source_validation_batches": "batches",
    "token_byte_lengths": "token_bytes",
    "build_demo_corpus": "demo_corpus",
    "IGNORE_INDEX": "packing",
    "Masker": "packing",
    "Packer": "packing",
    "mask_seed": "packing",
    "BadRecordError": "bad_records",
    "resolve_sources": "sources",
    "SPECIAL_TOKENS": "tokenizer",
    "load_or_train_tokenizer": "tokenizer",
    "separator_id": "tokenizer",
    "training_documents": "tokenizer",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from pretrain.data.bad_records import BadRecordError
    from pretrain.data.baseline import cached_unigram_baseline_loss, unigram_baseline_loss
    from pretrain.data.batches import (
        TrainBatches,
        data_throughput,
        merge_states,
        source_validation_batches,
        validation_batches,
        validation_sequences,
    )
    from pretrain.data.demo_corpus import build_demo_corpus
    from pretrain.data.packing import IGNORE_INDEX, Masker, Packer, mask_seed
    from pretrain.data.sources import resolve_sources
    from pretrain.data.token_bytes import token_byte_lengths
    from pretrain.data.tokenizer import SPECIAL_TOKENS, load_or_train_tokenizer, separator_id, training_documents


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pretrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pretrain.data.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
