"""The training function run on every worker — under Ray Train, under torchrun, or in one process: it wires the
run plan, the :class:`~pretrain.train.module.TrainModule`, the data and the callbacks into a
:class:`~pretrain.train.trainer.Trainer`, runs it, and reports the summary."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pretrain import timeline
from pretrain.checkpoint import layout
from pretrain.checkpoint.hash_tally import hash_tally
from pretrain.config import from_dict, make_plan, source_name
from pretrain.data import (
    TrainBatches,
    load_or_train_tokenizer,
    source_validation_batches,
    token_byte_lengths,
    validation_batches,
)
from pretrain.data.bad_records import BadRecords, summarize_bad_records, summary_line
from pretrain.data.tasks import load_tasks
from pretrain.model.compile import is_compiled
from pretrain.train import dist
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.standard import RunParts, standard_callbacks
from pretrain.train.callbacks.task_evaluation import prepare_tasks, task_part
from pretrain.train.checkpointer import Checkpointer
from pretrain.train.host_memory import keep_freed_host_memory
from pretrain.train.job import Job
from pretrain.train.module import build_module
from pretrain.train.progress import Progress
from pretrain.train.resume import checkpoint_architecture, ep_size_of, find_resume_point, restore, resume_source
from pretrain.train.stability.control import StabilityControl
from pretrain.train.tracking import THREADS_TAG, Tracker
from pretrain.train.trainer import Trainer, TrainerState


def train_loop(job: dict[str, Any]) -> dict[str, Any]:
    """Train per ``job`` (a ``Job`` as dict). Returns the final metrics (rank 0's view)."""
    trainer = build_trainer(job)
    try:
        final = trainer.fit()
    except BaseException:
        with contextlib.suppress(Exception):  # what was logged before the error; the error itself comes first
            trainer.tracker.flush()
        raise
    trainer.tracker.flush(final=True)  # metrics are logged asynchronously
    if unsent := trainer.tracker.unsent():
        trainer.progress.say(f"warning: {unsent:,} metric values are not in MLflow (its store refused them to the end)")
    return final


def build_trainer(job: dict[str, Any], extra_callbacks: Sequence[Callback] = ()) -> Trainer:
    """This worker's :class:`Trainer` for ``job``: the plan, the module (resumed when a committed checkpoint
    exists), the data, the standard callbacks (those of the enabled features) and ``extra_callbacks``."""
    job_ = Job(**job)
    hashed_at_setup = hash_tally()  # what the resume verification hashes is counted from here
    if job_.startup:
        timeline.adopt(job_.startup)
        timeline.enter("worker_setup")
    else:
        timeline.start("worker_setup", at=time.time())
    cfg = from_dict(job_.config)
    ctx = dist.setup(cfg.cluster.use_gpu)
    # Divide the node's CPUs among its local workers (Ray would otherwise leave one thread each).
    threads = cfg.train.num_threads or max(1, _cpu_count() // ctx.local_world_size)
    torch.set_num_threads(threads)
    if cfg.train.reuse_host_memory:
        keep_freed_host_memory()
    plan = make_plan(cfg, ctx.world_size)
    run_dir = Path(job_.run_dir)
    tracker = Tracker(job_.tracking_uri if ctx.is_main else "", job_.run_id, asynchronous=True, probe=False)

    tokenizer = load_or_train_tokenizer(cfg.data)
    resume = find_resume_point(cfg, run_dir, ctx)
    if resume is not None and cfg.growth.schedule:  # the architecture as of that checkpoint (grown or not yet)
        cfg = checkpoint_architecture(cfg, resume)
        plan = make_plan(cfg, ctx.world_size)  # its layout: experts grown from a dense model are expert-parallel
    source = resume_source(resume, run_dir, ctx, ep_size_of(cfg), plan.dims.tensor) if resume is not None else None
    weights = None
    if job_.init_weights and resume is None:  # the model.init_from_hf weights start the run
        weights = torch.load(job_.init_weights, weights_only=True)
    elif resume is not None and ctx.is_main:  # a checkpoint holds the run now: the converted copy has served
        (run_dir / layout.INIT_WEIGHTS).unlink(missing_ok=True)
    if source is not None and source.weights is not None:  # a full-weights checkpoint (a derived run)
        weights = source.weights
    timeline.enter("engine_build")
    module = build_module(
        cfg,
        plan,
        rank=ctx.rank,
        device=ctx.device,
        weights=weights,
        load_universal=source is not None and source.universal,
    )
    timeline.enter("trainer_setup")  # data, validation set, resume, callbacks
    batches = TrainBatches(
        cfg.data, kind=cfg.model.kind, tokenizer=tokenizer, plan=plan, rank=ctx.rank, seed=cfg.train.seed
    )
    val_args: dict[str, Any] = dict(
        kind=cfg.model.kind,
        seq_len=plan.seq_len,
        tokenizer=tokenizer,
        val_sequences=plan.val_sequences,
        micro_batch=plan.micro_batch,
        seed=cfg.train.seed,
        part=plan.val_part(ctx.rank),
    )
    val_bad = BadRecords(cfg.data.bad_records)  # those of data.val_sources are reported below (rank 0)
    val_set = validation_batches(cfg.data, **val_args, bad=val_bad)
    per_source, skipped = source_validation_batches(cfg.data, **val_args)
    group = cfg.data.val_sources or cfg.data.sources
    only = source_name(group[0].path, group[0].name) if val_set and len(group) == 1 else ""
    byte_lengths = (
        token_byte_lengths(tokenizer, max(cfg.model.vocab_size, len(tokenizer)))
        if cfg.model.kind == "decoder"
        else None
    )

    tasks = prepare_tasks(
        load_tasks(
            cfg.eval.tasks,
            cfg.data,
            max_examples=cfg.eval.max_examples,
            num_choices=cfg.eval.num_choices,
            seed=cfg.train.seed,
        ),
        tokenizer,
        cfg.model.kind,
        plan.seq_len,
        *task_part(plan, ctx.rank),
    )

    state = TrainerState()
    if resume is not None:
        assert source is not None  # resolved above for every resume point
        state = restore(module, batches, source, ctx)
    progress = Progress(cfg.train.max_steps, state.step, plan.tokens_per_step, ctx.is_main)
    if resume is not None:
        progress.say(f"resumed from {resume.path} (step {state.step}, {state.tokens_seen:,} tokens)")
    progress.say(
        f"{ctx.world_size} worker(s), device {ctx.device.type}, {module.precision}, ZeRO-{cfg.zero.stage}, "
        f"{threads} thread(s)/worker, compiled blocks {'on' if is_compiled(module.model) else 'off'}"
    )
    progress.say(plan.describe())
    tracker.set_tags({THREADS_TAG: threads})  # what its seconds (val/train_s) were measured with (rank 0: tracked)
    if cfg.data.val_sources and val_bad.total:  # (those of a val_holdout are training's: its summary counts them)
        progress.say(f"validation: data.val_sources: {summary_line(summarize_bad_records([val_bad]))}")
    if skipped:
        progress.say(f"per-source validation: {', '.join(skipped)} too small for one sequence (only in val/loss)")
    if not tracker.log_params(plan.params()):  # resumed on another layout: params are immutable
        tracker.log_json(plan.params(), f"plan/step_{state.step:08d}.json")

    control = StabilityControl(cfg, state, ctx, run_dir, tracker, progress)
    checkpointer = Checkpointer(cfg, run_dir, ctx, tracker)
    callbacks = standard_callbacks(
        RunParts(
            cfg,
            control,
            checkpointer,
            job_.tracking_uri,
            plan,
            ctx.rank,
            run_id=job_.run_id,
            tokenizer=tokenizer,
            per_source=per_source,
            only_source=only,
            tasks=tasks,
            hashed_at_setup=hashed_at_setup,
            data_fingerprint=job_.data_fingerprint,
            byte_lengths=byte_lengths,
        )
    )
    return Trainer(
        cfg=cfg,
        plan=plan,
        ctx=ctx,
        module=module,
        batches=batches,
        val_set=val_set,
        state=state,
        tracker=tracker,
        progress=progress,
        run_dir=run_dir,
        callbacks=[*callbacks, *extra_callbacks],
        last_checkpoint=resume.path if resume is not None else None,
    )


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
