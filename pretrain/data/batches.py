"""Training batches over virtual streams, the validation set, and a data-throughput probe.

One optimizer step takes ``global_batch_size / num_streams`` sequences from *every* virtual stream.
Worker ``rank`` of ``world_size`` owns the streams ``s`` with ``s % world_size == rank`` (when the worker count
does not divide the stream count, some workers own one stream more: see ``pretrain/config/plan.py``) and returns,
for each owned stream in ascending order, its next ``G/S`` sequences, concatenated (in packing order, or drawn
from the stream's shuffle buffer: ``data.shuffle_sequences``, :mod:`pretrain.data.packed_stream`). Streams are
packed, shuffled and masked independently of each other and of the worker count, so with
``micro_batch_size`` dividing ``G/S`` every micro-batch is the same whatever the number of workers.

``state_dict()`` holds, per owned stream, the document-stream position (``datasets`` state of each
source, mixture draws, document index, epoch), the packer buffer, the shuffle buffer, the sequences emitted and
the bad-record counters. ``load_state_dict`` takes the union of the workers' states (see
:func:`merge_states`) and restores the streams this worker owns, so resuming with another worker
count is exact.

``prefetch()`` fetches the next step's batch in a background thread (the trainer calls it while the step
computes); ``next_step`` then returns that batch. The batches and their order do not change, and
``state_dict()`` / ``bad_record_summary()`` stay those of the batches *taken* (a snapshot from before the
prefetch), so a checkpoint never counts a batch the loop has not trained on.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import numpy as np
import torch

from pretrain.config import ConfigError, DataConfig, RunPlan, layout, source_name
from pretrain.data.bad_records import BadRecords, summarize_bad_records
from pretrain.data.packed_stream import FRESH, PackedStream, as_lists
from pretrain.data.packing import Masker, Packer, make_example, mask_seed
from pretrain.data.sources import training_sources, validation_sources
from pretrain.data.stream import DocumentStream, unique_documents
from pretrain.data.tokenizer import make_encoder, separator_id

STATE_VERSION = 1


def _check_kind(kind: str) -> None:
    if kind not in ("decoder", "encoder"):
        raise ValueError(f"model kind must be decoder or encoder, got {kind!r}")


class TrainBatches:
    """This worker's share of every optimizer step (see the module docstring)."""

    def __init__(self, cfg: DataConfig, *, kind: str, tokenizer, plan: RunPlan, rank: int, seed: int):
        _check_kind(kind)
        if not 0 <= rank < plan.workers:
            raise ValueError(f"rank {rank} out of range for the plan's {plan.workers} workers")
        if plan.num_streams != cfg.num_streams:
            raise ValueError(f"the plan has {plan.num_streams} streams, data.num_streams is {cfg.num_streams}")
        self.cfg, self.kind, self.seq_len, self.tokenizer = cfg, kind, plan.seq_len, tokenizer
        self.plan, self.rank, self.seed = plan, rank, seed
        self.owned = plan.owned_streams(rank)
        self._sources = training_sources(cfg)
        self._encode = make_encoder(tokenizer)
        self._separator = separator_id(tokenizer)
        self._masker = Masker(tokenizer, cfg.mlm_probability) if kind == "encoder" else None
        self._streams = {s: self._make_stream(s) for s in self.owned}
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: Future | None = None  # -> (state before the batch, batch or None, StopIteration or None)
        self._before: dict | None = None  # repeat off: the state before the last batch served (:meth:`rewind`)

    def _make_stream(self, s: int, state: dict | None = None) -> PackedStream:
        return PackedStream(
            s,
            self._sources,
            self.cfg,
            self.seed,
            self.cfg.num_streams,
            self._encode,
            self._separator,
            self.seq_len,
            state,
        )

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_step()

    def next_step(self) -> dict[str, torch.Tensor]:
        """This worker's ``G/W`` sequences of the next step (the prefetched one if any); StopIteration when the
        data ends (repeat off)."""
        if self._ahead is not None:
            before, batch, ended = self._take_ahead()
            if ended is not None:
                raise ended
            assert batch is not None  # a batch, or the end of the data
            self._before = None if self.cfg.repeat else before
            return batch
        self._before = None if self.cfg.repeat else self._snapshot()
        return self._fetch()

    def rewind(self) -> None:
        """Put back the last batch served (repeat off): the step it was for never trains because another worker's
        data ended there, and the position a checkpoint records is then the one a run on any worker count reaches
        (a one-worker run serves no part of that step)."""
        if self._before is None:
            return
        if self._ahead is not None:
            self._take_ahead()  # a batch prefetched after the rewound one
        before, self._before = self._before, None
        self.load_state_dict(as_lists(before))

    def prefetch(self) -> None:
        """Start fetching the next step's batch in a background thread (no-op when one is already ahead)."""
        if self._ahead is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
            self._ahead = self._pool.submit(self._fetch_ahead)

    def _snapshot(self) -> dict:
        """The state now, copied so that reading on cannot change it: deeply, but for the buffers (fresh lists of
        ints, or arrays, that nothing changes, and the largest part)."""
        state = self._state_now(lists=False)
        streams = {}
        for key, st in state["streams"].items():
            rest = copy.deepcopy({k: v for k, v in st.items() if k not in FRESH})
            streams[key] = {k: (v if k in FRESH else rest[k]) for k, v in st.items()}
        return {**copy.deepcopy({k: v for k, v in state.items() if k != "streams"}), "streams": streams}

    def _fetch_ahead(self) -> tuple[dict, dict[str, torch.Tensor] | None, StopIteration | None]:
        state = self._snapshot()  # the resume point of the batches taken so far
        try:
            return state, self._fetch(), None
        except StopIteration as e:
            return state, None, e

    def _take_ahead(self) -> tuple[dict, dict[str, torch.Tensor] | None, StopIteration | None]:
        ahead, self._ahead = self._ahead, None
        assert ahead is not None  # callers check that a batch is ahead
        return ahead.result()  # an error of the fetch (not the end of the data) is raised here

    def _fetch(self) -> dict[str, torch.Tensor]:
        T, n = self.seq_len, self.plan.per_stream
        ended = False
        for s in self.owned:  # fill first: a step is either served whole or not at all
            try:
                self._streams[s].fill(n)
            except StopIteration:
                ended = True  # keep filling the others, so every stream reads (and reports) to its end
        if ended:
            raise StopIteration
        if self.kind == "decoder":  # no masking: every stream's next n sequences
            x = torch.from_numpy(np.concatenate([self._streams[s].take(n) for s in self.owned]).reshape(-1, T))
            return {"input_ids": x, "labels": x.clone()}
        inputs, labels = [], []
        for s in self.owned:
            stream = self._streams[s]
            for _ in range(n):
                seed = mask_seed(self.seed, s, stream.sequences)
                x, y = make_example(stream.take(1), self.kind, self._masker, seed)
                inputs.append(x)
                labels.append(y)
        return {"input_ids": torch.stack(inputs), "labels": torch.stack(labels)}

    def _meta(self) -> dict:
        return {
            "version": STATE_VERSION,
            "num_streams": self.cfg.num_streams,
            "seq_len": self.seq_len,
            "kind": self.kind,
            "shuffle_sequences": self.cfg.shuffle_sequences,
        }

    def state_dict(self) -> dict:
        """JSON-serializable state of this worker's streams (each stream also carries the metadata): the position
        after the batches taken, not counting a prefetched one."""
        if self._ahead is not None:
            return as_lists(copy.deepcopy(self._ahead.result()[0]))
        return self._state_now()

    def _state_now(self, lists: bool = True) -> dict:
        meta = self._meta()
        streams = {str(s): {**meta, **self._streams[s].state_dict(lists)} for s in self.owned}
        return {**meta, "streams": streams}

    def load_state_dict(self, state: dict) -> None:
        """Restore this worker's streams from ``{"streams": {"0": ..., ...}, ...}`` holding (at least) all of
        them: the union of any number of workers' states, so the worker count may change."""
        streams = state.get("streams", {})
        missing = [s for s in self.owned if str(s) not in streams]
        if missing:
            raise ValueError(f"data state: no state for streams {missing} (merge all workers' states)")
        if self._ahead is not None:
            self._take_ahead()  # a prefetched batch of the old position is dropped
        meta = self._meta()
        for where, part in [("", state)] + [(f"streams.{s}.", streams[str(s)]) for s in self.owned]:
            for key, mine in meta.items():
                if key in part and part[key] != mine:
                    raise ValueError(f"data state: {where}{key} was {part[key]!r}, now {mine!r}")
        self._streams = {s: self._make_stream(s, streams[str(s)]) for s in self.owned}

    def bad_record_summary(self) -> dict:
        """Bad records of the batches taken (a prefetched batch's are not counted)."""
        return summarize_bad_records(self.bad_record_counters())

    def bad_record_counters(self) -> list[BadRecords]:
        """The bad-record counter of each stream this worker reads, as of the batches taken."""
        if self._ahead is None:
            return [self._streams[s].bad for s in self.owned]
        streams = self._ahead.result()[0]["streams"]
        counters = []
        for s in self.owned:
            bad = BadRecords(self.cfg.bad_records)
            bad.load_state_dict(streams[str(s)]["bad"])
            counters.append(bad)
        return counters


def merge_states(states: list[dict]) -> dict:
    """The union of several workers' ``TrainBatches.state_dict()`` (for an elastic resume)."""
    if not states:
        raise ValueError("no data states to merge")
    merged = {k: v for k, v in states[0].items() if k != "streams"}
    merged["streams"] = {}
    for st in states:
        for k in ("version", "num_streams", "seq_len", "kind"):
            if st.get(k) != merged.get(k):
                raise ValueError(f"data states disagree on {k}: {st.get(k)!r} != {merged.get(k)!r}")
        merged["streams"].update(st["streams"])
    return merged


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


class TooLittleValidationData(ConfigError):
    """The validation data holds fewer tokens than one sequence (a user error, one line; per source, that source is
    left to the aggregate set)."""


def validation_sequences(
    cfg: DataConfig,
    *,
    kind: str,
    seq_len: int,
    tokenizer,
    val_sequences: int,
    seed: int,
    bad: BadRecords | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global validation set: the first ``val_sequences`` packed sequences of the validation stream. ``bad``
    (a ``BadRecords(cfg.bad_records)`` of the caller's, to report after) counts the bad records read; by default a
    counter of its own."""
    _check_kind(kind)
    role: Literal["train", "val", "all"]
    if cfg.val_sources:
        sources, role, holdout = validation_sources(cfg), "all", 0.0
    elif cfg.val_holdout > 0:
        sources, role, holdout = training_sources(cfg), "val", cfg.val_holdout
    else:
        return []
    if val_sequences <= 0:
        return []
    bad = bad if bad is not None else BadRecords(cfg.bad_records)
    docs = DocumentStream(sources, seed, role=role, val_holdout=holdout, bad=bad)
    packer = Packer(unique_documents(docs), make_encoder(tokenizer), separator_id(tokenizer), seq_len)
    masker = Masker(tokenizer, cfg.mlm_probability) if kind == "encoder" else None
    out = []
    for k in range(val_sequences):
        try:
            ids = packer.next_sequence()
        except StopIteration:
            break
        out.append(make_example(ids, kind, masker, mask_seed(seed, "val", k)))
    if not out:
        raise TooLittleValidationData(
            f"validation: {_validation_data(cfg)} has fewer than seq_len={seq_len} tokens (a document repeated "
            f"counts once); {_more_validation(cfg)}"
        )
    return out


def _validation_data(cfg: DataConfig) -> str:
    return "data.val_sources" if cfg.val_sources else f"the {cfg.val_holdout:g} holdout of data.sources"


def _more_validation(cfg: DataConfig) -> str:
    """What gives validation more data (``data.val_holdout`` does nothing where ``data.val_sources`` is set)."""
    return "add data to data.val_sources" if cfg.val_sources else "add data or raise data.val_holdout"


def validation_batches(
    cfg: DataConfig,
    *,
    kind: str,
    seq_len: int,
    tokenizer,
    val_sequences: int,
    micro_batch: int,
    seed: int,
    part: slice = slice(None),
    bad: BadRecords | None = None,
) -> list[dict[str, torch.Tensor]]:
    """The ``part`` of the validation set (a worker's: ``RunPlan.val_part``; all by default), in micro-batches;
    ``bad`` as :func:`validation_sequences` takes it."""
    if micro_batch <= 0:
        raise ValueError(f"micro_batch must be > 0, got {micro_batch}")
    seqs = validation_sequences(
        cfg, kind=kind, seq_len=seq_len, tokenizer=tokenizer, val_sequences=val_sequences, seed=seed, bad=bad
    )
    ranks = part.step or 1  # a worker's part: every data-parallel rank's is one of these strides
    if seqs and len(seqs) < ranks:  # a rank without a sequence would skip the collective validation the others run
        raise TooLittleValidationData(
            f"validation: {_validation_data(cfg)} gives {len(seqs)} sequence(s) of seq_len={seq_len} tokens; "
            f"{ranks} data-parallel workers need at least one each: {_more_validation(cfg)}"
        )
    seqs = seqs[part]
    return [
        {
            "input_ids": torch.stack([x for x, _ in seqs[i : i + micro_batch]]),
            "labels": torch.stack([y for _, y in seqs[i : i + micro_batch]]),
        }
        for i in range(0, len(seqs), micro_batch)
    ]


def source_validation_batches(
    cfg: DataConfig,
    *,
    kind: str,
    seq_len: int,
    tokenizer,
    val_sequences: int,
    micro_batch: int,
    seed: int,
    part: slice = slice(None),
) -> tuple[dict[str, list[dict[str, torch.Tensor]]], list[str]]:
    """One validation set per source, by name (:func:`pretrain.config.source_name`): each ``data.val_sources``
    entry, or without them each training source's own held-out share — built exactly as the aggregate set is,
    from that source alone (``val_sequences`` sequences each, this ``part``). With a single source the set is
    the aggregate one: nothing is returned for it (the caller reuses ``val/*``). Also returns the names of
    sources too small for one sequence (skipped)."""
    group, field = (cfg.val_sources, "val_sources") if cfg.val_sources else (cfg.sources, "sources")
    if len(group) < 2 or val_sequences <= 0 or not (cfg.val_sources or cfg.val_holdout > 0):
        return {}, []
    sets, skipped = {}, []
    for src in group:
        name = source_name(src.path, src.name)
        changes: dict[str, Any] = {field: [dataclasses.replace(src, weight=1.0)]}
        one = dataclasses.replace(cfg, **changes)
        try:
            sets[name] = validation_batches(
                one,
                kind=kind,
                seq_len=seq_len,
                tokenizer=tokenizer,
                val_sequences=val_sequences,
                micro_batch=micro_batch,
                seed=seed,
                part=part,
            )
        except TooLittleValidationData:  # only the aggregate covers this source (bad records, bad shards: raised)
            skipped.append(name)
    return sets, skipped


# ----------------------------------------------------------------------------------------------
# Throughput
# ----------------------------------------------------------------------------------------------


def data_throughput(
    cfg: DataConfig, *, kind: str, seq_len: int, tokenizer, seconds: float = 3.0, global_batch: int | None = None
) -> float:
    """Tokens/s of raw text -> packed (and masked) batches: one process, one thread, all streams.

    Measures ``TrainBatches`` on one worker (so every virtual stream's reading is included)
    with ``torch`` limited to one thread and tokenizer parallelism off, after one warm-up step. A step is
    ``global_batch`` sequences (default: about 2,048 tokens' worth, at least one sequence per stream).
    """
    threads = torch.get_num_threads()
    env = os.environ.get("TOKENIZERS_PARALLELISM")
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        G = global_batch or cfg.num_streams * max(1, 2048 // (cfg.num_streams * seq_len))
        plan = layout(world_size=1, global_batch=G, micro_cap=G, num_streams=cfg.num_streams, seq_len=seq_len)
        batches = TrainBatches(cfg, kind=kind, tokenizer=tokenizer, plan=plan, rank=0, seed=0)
        batches.next_step()
        tokens, start = 0, time.perf_counter()
        while True:
            try:
                batches.next_step()
            except StopIteration:
                break
            tokens += plan.tokens_per_step
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        elapsed = time.perf_counter() - start
        if tokens == 0:
            raise ValueError("data_throughput: the data ended before a single measured step")
        return tokens / elapsed
    finally:
        torch.set_num_threads(threads)
        if env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = env
