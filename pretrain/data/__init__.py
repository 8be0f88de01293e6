"""Data pipeline: sources and mixtures, tokenizer, virtual streams, packing, MLM masking, validation.

See :mod:`pretrain.data.stream` (mixtures, holdout, virtual streams), :mod:`pretrain.data.packing`
(packing and masking) and :mod:`pretrain.data.batches` (steps, exact and elastic resume).
"""

from pretrain.data.baseline import unigram_baseline_loss
from pretrain.data.batches import (
    TrainBatches,
    data_throughput,
    merge_states,
    validation_batches,
    validation_sequences,
)
from pretrain.data.demo_corpus import build_demo_corpus
from pretrain.data.packing import IGNORE_INDEX, Masker, Packer, mask_seed
from pretrain.data.sources import BadRecordError, resolve_sources
from pretrain.data.tokenizer import SPECIAL_TOKENS, load_or_train_tokenizer, separator_id, training_documents

__all__ = [
    "BadRecordError",
    "IGNORE_INDEX",
    "Masker",
    "Packer",
    "SPECIAL_TOKENS",
    "TrainBatches",
    "build_demo_corpus",
    "data_throughput",
    "load_or_train_tokenizer",
    "mask_seed",
    "merge_states",
    "resolve_sources",
    "separator_id",
    "training_documents",
    "unigram_baseline_loss",
    "validation_batches",
    "validation_sequences",
]
