"""The training function run on every worker — under Ray Train, under torchrun, or in one process: it wires the
run plan, the :class:`~pretrain.train.module.TrainModule`, the data and the callbacks into a
:class:`~pretrain.train.trainer.Trainer`, runs it, and reports the summary."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.config import from_dict, make_plan
from pretrain.data import TrainBatches, load_or_train_tokenizer, unigram_baseline_loss, validation_batches
from pretrain.model.compile import is_compiled
from pretrain.train import checkpoint as ckpt_io
from pretrain.train import dist
from pretrain.train.callbacks import Checkpointer, standard_callbacks
from pretrain.train.module import build_module
from pretrain.train.progress import Progress
from pretrain.train.resume import checkpoint_architecture, engine_state_dir, find_resume_point, restore
from pretrain.train.stability import StabilityControl
from pretrain.train.trainer import Trainer, TrainerState
from pretrain.train.tracking import Tracker

SUMMARY_FILE = "summary.json"


@dataclass(kw_only=True)
class Job:
    """Everything a worker needs; plain data so it travels to Ray workers."""

    config: dict
    """The resolved config (``to_dict(RunConfig)``)."""
    run_id: str
    """MLflow run id (or a local id when tracking is disabled)."""
    run_dir: str
    """Absolute checkpoint directory of this run."""
    tracking_uri: str = ""
    """MLflow tracking URI; empty disables tracking."""
    init_weights: str = ""
    """A full model state dict (``torch.save``, loaded with ``weights_only``) to start from instead of the seeded
    init, e.g. converted from ``model.init_from_hf`` by the driver; a resumed checkpoint overrides it."""


def train_loop(job: dict[str, Any]) -> dict[str, Any]:
    """Train per ``job`` (a ``Job`` as dict). Returns the final metrics (rank 0's view)."""
    job_ = Job(**job)
    cfg = from_dict(job_.config)
    ctx = dist.setup(cfg.cluster.use_gpu)
    # Divide the node's CPUs among its local workers (Ray would otherwise leave one thread each).
    threads = cfg.train.num_threads or max(1, _cpu_count() // ctx.local_world_size)
    torch.set_num_threads(threads)
    plan = make_plan(cfg, ctx.world_size)
    run_dir = Path(job_.run_dir)
    tracker = Tracker(job_.tracking_uri if ctx.is_main else "", job_.run_id)

    tokenizer = load_or_train_tokenizer(cfg.data)
    resume = find_resume_point(cfg, run_dir, ctx)
    if resume is not None and cfg.growth.schedule:  # the architecture as of that checkpoint (grown or not yet)
        cfg = checkpoint_architecture(cfg, resume)
    source = engine_state_dir(resume, run_dir, ctx) if resume is not None else None
    weights = torch.load(job_.init_weights, weights_only=True) if job_.init_weights else None
    module = build_module(cfg, plan, rank=ctx.rank, device=ctx.device, weights=weights,
                          load_universal=source is not None and source[1])
    data_kw = dict(kind=cfg.model.kind, seq_len=cfg.model.max_seq_len, tokenizer=tokenizer,
                   rank=ctx.rank, world_size=ctx.world_size)
    batches = TrainBatches(cfg.data, global_batch_size=plan.global_batch, seed=cfg.train.seed, **data_kw)
    val_set = validation_batches(cfg.data, val_sequences=cfg.train.val_sequences,
                                 micro_batch_size=plan.micro_batch, seed=cfg.train.seed, **data_kw)

    state = TrainerState()
    if resume is not None:
        state = restore(module, batches, resume, source, ctx)
    progress = Progress(cfg.train.max_steps, state.step, plan.tokens_per_step, ctx.is_main)
    if resume is not None:
        progress.say(f"resumed from {resume.path} (step {state.step}, {state.tokens_seen:,} tokens)")
    progress.say(f"{ctx.world_size} worker(s), device {ctx.device.type}, {module.precision}, ZeRO-{cfg.zero.stage}, "
                 f"{threads} thread(s)/worker, grad accum {plan.grad_accum}, "
                 f"compiled blocks {'on' if is_compiled(module.model) else 'off'}")
    progress.say(plan.describe())
    if not tracker.log_params(plan.params()):  # resumed on another layout: params are immutable
        tracker.log_json(plan.params(), f"plan/step_{state.step:08d}.json")

    control = StabilityControl(cfg, state, ctx, run_dir, tracker, progress)
    checkpointer = Checkpointer(cfg, run_dir, ctx, tracker)
    trainer = Trainer(cfg=cfg, plan=plan, ctx=ctx, module=module, batches=batches, val_set=val_set, state=state,
                      tracker=tracker, progress=progress, run_dir=run_dir,
                      callbacks=standard_callbacks(cfg, control, checkpointer, job_.tracking_uri, plan, ctx.rank),
                      last_checkpoint=resume.path if resume is not None else None)
    final = trainer.fit()
    final["run_id"] = job_.run_id
    _report(final, trainer, tokenizer, job_)
    return final


def _report(final: dict[str, Any], trainer: Trainer, tokenizer, job: Job) -> None:
    """Bad-record totals (collective), then on rank 0 the unigram baseline and the summary (MLflow + run dir)."""
    cfg, ctx, tracker, step = trainer.cfg, trainer.ctx, trainer.tracker, trainer.state.step
    bad = trainer.batches.bad_record_summary()
    bad["total"] = int(dist.all_reduce_sum([float(bad.get("total", 0))], ctx.device)[0])  # all streams
    final["bad_records"] = int(bad.get("total", 0))
    if not ctx.is_main:
        return
    if trainer.val_set:
        final["unigram_val_loss"] = unigram_baseline_loss(
            cfg.data, kind=cfg.model.kind, seq_len=cfg.model.max_seq_len, tokenizer=tokenizer,
            val_sequences=cfg.train.val_sequences, seed=cfg.train.seed)
        tracker.log_metrics({"val/unigram_baseline_loss": final["unigram_val_loss"]}, step)
    if bad.get("total"):
        trainer.progress.say(f"bad records skipped: {bad['total']} {bad.get('by_reason', {})}; "
                             f"first: {'; '.join(bad.get('examples', [])[:3])}")
    tracker.log_metrics({"data/bad_records": float(bad.get("total", 0))}, step)
    tracker.log_json(bad, "data/bad_records.json")
    tracker.log_json(final, "summary.json")
    ckpt_io.write_json(Path(job.run_dir) / SUMMARY_FILE, final)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
