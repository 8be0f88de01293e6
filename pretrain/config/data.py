"""The ``data`` section of the config tree and its sources (``data.sources``, ``data.val_sources``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class SourceConfig:
    path: str
    """A file, a glob, a directory, a directory of token shards (it holds the ``manifest.json`` that
    ``./launch.sh tokenize`` writes: read by memory map, docs/data.md), ``demo`` (the built-in corpus), or anything
    ``datasets.load_dataset`` accepts (a hub name or URL, when online)."""
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"
    """File format; ``auto`` decides from the extension (``.txt``, ``.jsonl``/``.json``, ``.parquet``)."""
    text_field: str = "text"
    """Field that holds the document text for json/parquet/hub records."""
    weight: float = 1.0
    """Relative sampling weight in a mixture of several sources."""
    name: str = ""
    """Name in metrics (``val/<name>/loss``) and MLflow datasets; empty: the path's stem (``data/web.jsonl`` ->
    ``web``). Letters, digits, ``_-.``; unique within ``data.sources`` and within ``data.val_sources``.
    Bad-record reports show it, or the path."""
    split: str = "train"
    """Split to stream for hub datasets."""


@dataclass(kw_only=True)
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig(path="demo")])
    """Training sources, mixed by weight."""
    val_sources: list[SourceConfig] = field(default_factory=list)
    """Validation sources; empty means hold out ``val_holdout`` of the training documents. ``val/loss`` is over
    all of them; with several, each is also logged as ``val/<name>/loss``."""
    val_holdout: float = 0.01
    """Fraction of training documents (chosen by a hash of their text) held out for validation when
    ``val_sources`` is empty. 0 disables validation."""
    tokenizer: str = ""
    """Directory of a Hugging Face fast tokenizer. Empty: the token shards' tokenizer when the sources are token
    shards, the Hugging Face model's with ``model.init_from_hf``, else a byte-level BPE trained on the sources
    (``tokenizer_vocab_size``, ``tokenizer_train_docs``)."""
    tokenizer_vocab_size: int = 8192
    """Vocabulary size of a tokenizer trained from the corpus."""
    tokenizer_train_docs: int = 50_000
    """How many documents from the training stream the tokenizer is trained on."""
    num_streams: int = 8
    """Virtual data streams: documents are dealt to streams by global document index, each stream is
    packed on its own, and data-parallel rank r of W reads the streams s with s % W == r. The global sample
    order therefore does not depend on the worker count. At least as many as the data-parallel ranks; when W
    does not divide it, some ranks read one stream more and the others pad (``pretrain/config/plan.py``).
    ``train.global_batch_size`` must be a multiple of it."""
    bad_records: Literal["skip", "fail"] = "skip"
    """Malformed records (bad JSON, missing text field, undecodable bytes, empty text): ``skip`` counts
    and reports them (file and line); ``fail`` stops with a one-line error."""
    allow_changed: bool = False
    """Resume even though a source changed since the checkpoint (size or sampled content; see
    ``pretrain/data/fingerprint.py``), which a resume otherwise refuses: the data position then no longer means
    the same documents. The new fingerprint is recorded in MLflow (``data/fingerprint.json``, tag
    ``pretrain.data.changed``)."""
    mlm_probability: float = 0.15
    """Encoders: fraction of tokens selected for prediction (of which 80% [MASK], 10% random, 10% kept)."""
    repeat: bool = True
    """Restart the sources when exhausted (multi-epoch) instead of ending training."""
    cache_dir: str = ".cache/pretrain"
    """Where the built-in demo corpus is materialized (relative paths resolve against the launch dir)."""
    shuffle_sequences: int = 0
    """Sequences each virtual stream holds in a shuffle buffer: every sequence the stream packs enters it, and each
    one taken is drawn from it at random (seeded by ``train.seed``, the stream and its count: the same for any
    worker count, and exact on resume, the buffer being part of the data state). Consecutive sequences of a long
    document then reach steps far apart instead of consecutive ones; 0 takes them in packing order. At the end of
    the data (``repeat: false``) the buffer is drained. Its tokens are in every checkpoint's data state
    (``shuffle_sequences x max_seq_len`` per stream)."""
    piece_chars: int = 0
    """Cut every txt/jsonl training document longer than this many characters into pieces of at most this
    size (at a space where possible), each a document of its own for the virtual streams and the validation
    holdout; 0 never cuts. ``train`` sets it (about one sequence of text) when the sources hold too few
    documents for a document-level holdout and the streams, e.g. one huge line: a sequence-level split."""
