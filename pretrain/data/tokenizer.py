"""Tokenizer: load a Hugging Face fast tokenizer, or train a byte-level BPE on the training sources.

The trained tokenizer is a GPT-2 style byte-level BPE (any text round-trips, no unknown bytes) with
special tokens ``<|endoftext|>`` (id 0: eos, bos and the document separator), ``<|pad|>`` (1),
``<|mask|>`` (2) and ``<|unk|>`` (3). It is trained on the first ``tokenizer_train_docs`` training
documents (bad records skipped, validation holdout excluded) in mixture order with seed 0, so it
depends only on the data config: training is deterministic (checked by the tests).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pretrain.config import ConfigError, DataConfig
from pretrain.data.bad_records import BadRecords
from pretrain.data.sources import training_sources
from pretrain.data.stream import DocumentStream

EOS, PAD, MASK, UNK = "<|endoftext|>", "<|pad|>", "<|mask|>", "<|unk|>"
SPECIAL_TOKENS = [EOS, PAD, MASK, UNK]
TOKENIZER_DATA_SEED = 0
MIN_FREQUENCY = 2
TRAINER_SETTINGS = {
    "kind": "byte-level-bpe",
    "special_tokens": SPECIAL_TOKENS,
    "min_frequency": MIN_FREQUENCY,
    "add_prefix_space": False,
    "data_seed": TOKENIZER_DATA_SEED,
}
"""What a trained tokenizer depends on besides the data config (part of its cache key: tokenizer_cache.py)."""

if TYPE_CHECKING:  # transformers is imported where a tokenizer is built (a cached one is only copied)
    from transformers import PreTrainedTokenizerFast


def training_documents(
    cfg: DataConfig, seed: int = TOKENIZER_DATA_SEED, limit: int | None = None, bad: BadRecords | None = None
):
    """The training documents in global (mixture) order, one pass, holdout removed."""
    docs = DocumentStream(
        training_sources(cfg),
        seed,
        role="train",
        val_holdout=cfg.val_holdout if not cfg.val_sources else 0.0,
        bad=bad or BadRecords(cfg.bad_records),
    )
    return docs if limit is None else itertools.islice(docs, limit)


def train_tokenizer(texts, vocab_size: int) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"data.tokenizer_vocab_size: {vocab_size} is below the 260 of a byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=MIN_FREQUENCY,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )


def load_or_train_tokenizer(cfg: DataConfig, out_dir: Path | str | None = None) -> PreTrainedTokenizerFast:
    """``cfg.tokenizer`` (a local tokenizer directory) or a BPE trained on the training documents."""
    from transformers import PreTrainedTokenizerFast

    if cfg.tokenizer:
        path = Path(cfg.tokenizer).expanduser()
        if not path.is_dir():
            raise ValueError(f"data.tokenizer: {cfg.tokenizer} is not a directory with a saved tokenizer")
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - one clear line for a broken directory
            raise ValueError(f"data.tokenizer: cannot load a fast tokenizer from {cfg.tokenizer}: {e}") from e
        separator_id(tok)
    else:
        tok = train_tokenizer(training_documents(cfg, limit=cfg.tokenizer_train_docs), cfg.tokenizer_vocab_size)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(out_dir))
    return tok


def separator_id(tokenizer) -> int:
    """The document separator appended after every document: eos (or sep for BERT-like tokenizers)."""
    for attr in ("eos_token_id", "sep_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise ConfigError(
        "the tokenizer has neither an eos nor a sep token to separate documents: give one that has (eos_token in "
        "its tokenizer_config.json), or leave data.tokenizer unset and let the run train its own"
    )


def mask_id(tokenizer, label: str = "the tokenizer") -> int:
    """The mask token a masked LM (an encoder) trains and is scored with; one line naming the fix when
    ``tokenizer`` (``label``: where it came from) has none."""
    value = getattr(tokenizer, "mask_token_id", None)
    if value is None:
        raise ConfigError(
            f"{label} has no mask token, which a masked LM (model.kind: encoder) needs: give one that has "
            "(mask_token in its tokenizer_config.json), or leave data.tokenizer unset and let the run train its own"
        )
    return int(value)


def make_encoder(tokenizer):
    """Fast batch encoder ``list[str] -> list[list[int]]`` (no special tokens added, no BOS; a special token's text
    written in a document is that special token, as ``transformers``' tokenizers encode it). Every document whole:
    truncation or padding saved in a tokenizer's ``tokenizer.json`` (some published ones carry them) is not applied.
    A document that is already tokens (a NumPy array: token shards) is passed through as a list, in its place."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        if backend.truncation is not None or backend.padding is not None:  # a private copy without them
            from tokenizers import Tokenizer

            backend = Tokenizer.from_str(backend.to_str())
            backend.no_truncation()
            backend.no_padding()

        def encode_texts(texts: list[str]) -> list[list[int]]:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]

    else:

        def encode_texts(texts: list[str]) -> list[list[int]]:
            return tokenizer(texts, add_special_tokens=False, truncation=False, padding=False)["input_ids"]

    def encode(docs: list) -> list[list[int]]:
        texts = [d for d in docs if isinstance(d, str)]
        if len(texts) == len(docs):
            return encode_texts(docs)
        encoded = iter(encode_texts(texts) if texts else [])
        return [next(encoded) if isinstance(d, str) else d.tolist() for d in docs]

    return encode
