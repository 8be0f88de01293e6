"""The run plan: every number derived from the config and the worker count, computed once.

``train.global_batch_size`` is what the user chose and stays fixed; ``train.micro_batch_size`` is a
per-worker cap (memory). Worker ``r`` owns the virtual data streams ``s % W == r`` (see
``pretrain/data/batches.py``) and takes ``G / S`` sequences from each per step, so its share is
``owned streams x G / S`` sequences — equal on every worker when ``W`` divides ``S``, otherwise a few
workers hold one stream more. The micro-batch is the largest size within the cap that divides every
worker's share; each worker runs ``share / micro`` micro-batches and, when the shares differ, the
others pad with zero-weight micro-batches so every worker runs the same number of forwards and
backwards (ZeRO and expert-parallel collectives stay matched). Gradients are scaled so that the
update is the mean over the real micro-batches, whatever the layout.

Nothing else re-derives these numbers: the step, the data, the DeepSpeed config, the progress
output and MLflow all read them from the plan. This module knows no config class (it sits below ``tree.py``):
``make_plan(cfg, world_size)``, which reads the config and is the last step of ``RunConfig.validate()``, is
defined in ``tree.py`` and exported by ``pretrain.config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.config.errors import ConfigError
from pretrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class RunPlan:
    world_size: int
    """Data-parallel ranks: the workers that take different sequences (all workers without model parallelism).
    Methods taking a ``rank`` take a worker's global rank and use its data-parallel rank (:meth:`data_rank`)."""
    global_batch: int
    """Sequences per optimizer step over all workers (``train.global_batch_size``)."""
    seq_len: int
    """Tokens per sequence."""
    num_streams: int
    """Virtual data streams (``data.num_streams``)."""
    micro_batch: int
    """Sequences per forward/backward on one worker (<= ``train.micro_batch_size``)."""
    shares: tuple[int, ...]
    """Sequences each worker takes per step (sum = ``global_batch``)."""
    grad_accum: int
    """Forward/backward passes per worker per step (the largest share / ``micro_batch``)."""
    val_sequences: int
    """Sequences of the global validation set (``train.val_sequences``; 0 = no validation)."""
    val_shares: tuple[int, ...]
    """Validation sequences per data-parallel rank (the sequences :meth:`val_part` selects)."""
    dims: ParallelDims = ParallelDims()
    """The parallel layout of all workers (``pretrain/parallel/dims.py``): degrees, rank mapping, process groups.
    :func:`layout` without ``dims``: data parallelism only."""

    @property
    def sequence_parallel(self) -> int:
        """Workers sharing each sequence (``parallel.sequence``)."""
        return self.dims.sequence

    @property
    def tensor_parallel(self) -> int:
        """Workers sharing each layer (``parallel.tensor``)."""
        return self.dims.tensor

    @property
    def model_parallel(self) -> int:
        """Workers that train on the same sequences (sequence x tensor parallel)."""
        return self.dims.model_parallel

    @property
    def workers(self) -> int:
        """All workers: data-parallel ranks x :attr:`model_parallel`."""
        return self.dims.world

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of worker ``rank`` (:meth:`ParallelDims.data_rank`)."""
        return self.dims.data_rank(rank)

    def shares_data(self, rank: int) -> bool:
        """Whether worker ``rank`` is the first of the workers training on its sequences (the one whose sums count
        when every worker's are added up)."""
        return self.dims.shares_data(rank)

    def share(self, rank: int) -> int:
        """Sequences worker ``rank`` takes per step (its data-parallel rank's share)."""
        return self.shares[self.data_rank(rank)]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def per_stream(self) -> int:
        """Sequences each virtual data stream contributes to one step."""
        return self.global_batch // self.num_streams

    def owned_streams(self, rank: int) -> list[int]:
        """The virtual data streams worker ``rank`` reads, in the order its share concatenates them."""
        return list(range(self.data_rank(rank), self.num_streams, self.world_size))

    def val_part(self, rank: int) -> slice:
        """Which sequences of the global validation set worker ``rank`` evaluates."""
        return slice(self.data_rank(rank), self.val_sequences, self.world_size)

    @property
    def even(self) -> bool:
        """Every worker takes the same share (no padding micro-batches)."""
        return len(set(self.shares)) == 1

    @property
    def real_micro_batches(self) -> int:
        """Micro-batches with data in one step, over all workers."""
        return self.global_batch // self.micro_batch

    def micro_batches(self, rank: int) -> int:
        """Micro-batches with data on ``rank`` (the rest of ``grad_accum`` are padding)."""
        return self.share(rank) // self.micro_batch

    def gradient_scale(self) -> float:
        """Factor on each real micro-batch's objective so that DeepSpeed's averaging (1/grad_accum per
        micro-batch, then the mean over workers) gives the mean over the real micro-batches."""
        return self.world_size * self.grad_accum / self.real_micro_batches

    def micro_batch_ids(self, rank: int) -> list[int]:
        """Global ids of ``rank``'s real micro-batches in one step, independent of the worker count.

        Rank r holds, in order, the G/S sequences of each stream s = r, r+W, r+2W, ...; when the
        micro-batch divides G/S each micro-batch lies in one stream, and its id is (stream, offset)
        flattened — the same id whichever worker holds it. Otherwise ids follow rank order."""
        n = self.micro_batches(rank)
        rank = self.data_rank(rank)
        if self.per_stream % self.micro_batch:
            first = sum(self.shares[:rank]) // self.micro_batch
            return [first + j for j in range(n)]
        per_stream = self.per_stream // self.micro_batch
        return [(rank + (j // per_stream) * self.world_size) * per_stream + j % per_stream for j in range(n)]

    def describe(self) -> str:
        shares = (
            f"{self.shares[0]} sequences/worker"
            if self.even
            else f"{'/'.join(map(str, self.shares))} sequences per worker (padded to equal passes)"
        )
        parallel = f" ({self.dims.describe()})" if self.model_parallel > 1 else ""
        return (
            f"plan: {self.workers} worker(s){parallel}, global batch {self.global_batch} x {self.seq_len} tokens "
            f"= {self.tokens_per_step:,} tokens/step; {shares}; micro-batch {self.micro_batch}, "
            f"grad accum {self.grad_accum}"
        )

    def params(self) -> dict[str, int | str]:
        """Flat values for MLflow params (``plan.*``)."""
        return {
            "plan.world_size": self.workers,
            "plan.data_parallel": self.world_size,
            "plan.sequence_parallel": self.sequence_parallel,
            "plan.tensor_parallel": self.tensor_parallel,
            "plan.global_batch": self.global_batch,
            "plan.micro_batch": self.micro_batch,
            "plan.grad_accum": self.grad_accum,
            "plan.tokens_per_step": self.tokens_per_step,
            "plan.shares": ",".join(map(str, self.shares)),
        }


def _largest_divisor_at_most(n: int, cap: int) -> int:
    if cap >= n:
        return n
    best, d = 1, 1
    while d * d <= n and d <= cap:  # divisors come in pairs (d, n // d): O(sqrt(n)), n <= MAX_GLOBAL_BATCH
        if n % d == 0:
            best = max(best, d, n // d if n // d <= cap else 0)
        d += 1
    return best


def layout(
    *,
    world_size: int,
    global_batch: int,
    micro_cap: int,
    num_streams: int,
    seq_len: int,
    val_sequences: int = 0,
    dims: ParallelDims | None = None,
    workers: int = 0,
) -> RunPlan:
    """The batch layout of ``world_size`` data-parallel ranks behind ``make_plan(cfg, world_size)`` (in ``tree.py``,
    beside the config it reads, which sets ``dims``; also what data-only tools, e.g. the data throughput probe, plan
    with); errors name the config keys. ``workers``: all the job's workers, when tensor or sequence parallelism
    groups them into fewer data-parallel ranks (the errors count both)."""
    if world_size < 1:
        raise ConfigError(f"cluster.num_workers: must be >= 1, got {world_size}")
    # the ranks that share the data: the workers, or their data-parallel groups under tensor/sequence parallelism
    group = max(1, workers // world_size)
    ranks = f"{world_size} data-parallel ranks ({world_size * group} workers)" if group > 1 else f"{world_size} workers"
    if world_size > num_streams:
        raise ConfigError(
            f"cluster.num_workers: {ranks} but only data.num_streams={num_streams} data streams "
            f"to share; set data.num_streams to a multiple of {world_size} (and train.global_batch_size to a "
            f"multiple of it) or use at most {num_streams * group} workers"
        )
    if global_batch <= 0 or global_batch % num_streams:
        raise ConfigError(
            f"train.global_batch_size: {global_batch} must be a positive multiple of "
            f"data.num_streams {num_streams}; set one of them so it is"
        )
    per_stream = global_batch // num_streams
    shares = tuple(per_stream * len(range(r, num_streams, world_size)) for r in range(world_size))
    micro = _largest_divisor_at_most(math.gcd(*shares), micro_cap)
    if 0 < val_sequences < world_size:  # every worker runs validation forwards (collectives under ZeRO-3)
        raise ConfigError(
            f"train.val_sequences: {val_sequences} is fewer than the {ranks}; set it to "
            f"at least {world_size} (or 0 to skip validation)"
        )
    val = tuple(len(range(r, val_sequences, world_size)) for r in range(world_size))
    return RunPlan(
        world_size=world_size,
        global_batch=global_batch,
        seq_len=seq_len,
        num_streams=num_streams,
        micro_batch=micro,
        shares=shares,
        grad_accum=max(shares) // micro,
        val_sequences=val_sequences,
        val_shares=val,
        dims=dims or ParallelDims(world=world_size),
    )
