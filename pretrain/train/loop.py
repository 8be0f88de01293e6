"""The training function run on every worker: under Ray Train, under torchrun, or in one process.

Generic loop, specific step: the step (LR, micro-batches, clipping via DeepSpeed) is one function;
validation, progress, MLflow and checkpoint commits happen around it on fixed intervals.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.config import RunConfig, config_hash, dump_yaml, from_dict
from pretrain.data import TrainBatches, load_or_train_tokenizer, unigram_baseline_loss, validation_batches
from pretrain.model import build_model, param_groups
from pretrain.model.moe import max_shares, routing_metrics
from pretrain.train import checkpoint as ckpt_io
from pretrain.train import dist
from pretrain.train.engine import initialize, resolve_precision
from pretrain.train.health import HealthProbe, nonfinite_params
from pretrain.train.progress import Progress
from pretrain.train.schedule import lr_at
from pretrain.train.stability import Decision, StabilityControl
from pretrain.train.step import evaluate, micro_batch_ids, run_step, step_seed
from pretrain.train.tracking import Tracker


SUMMARY_FILE = "summary.json"
SPIKE_LR_FACTOR = 1000.0  # faults.loss_spike_at_step


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


@dataclass
class TrainerState:
    """Loop counters, saved in every checkpoint."""

    step: int = 0
    tokens_seen: int = 0
    last_train_loss: float = float("nan")
    last_val: dict[str, float] = field(default_factory=dict)
    sequences: int = 0
    """Global sequences consumed (the data position; more than step * batch after a rollback)."""
    stability: dict[str, Any] = field(default_factory=dict)
    """``StabilityMonitor.state_dict()``: rolling statistics, counters, checkpoints, skipped windows, events."""
    faults_fired: list[str] = field(default_factory=list)
    """One-shot fault hooks already fired (so a rollback does not replay them)."""


class NonFiniteWeightsError(ckpt_io.CheckpointError):
    """The weights hold NaN/Inf: the checkpoint was not written."""


class Checkpointer:
    """Writes committed checkpoints of this run (collective: every rank calls ``save``)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, ctx: dist.DistContext, tracker: Tracker):
        self.cfg, self.run_dir, self.ctx, self.tracker = cfg, run_dir, ctx, tracker
        self.seconds = 0.0  # wall time spent in save (write + verify + commit)
        self.count = 0

    def save(self, engine, batches: TrainBatches, state: TrainerState, protect: set[str] = frozenset()) -> Path | None:
        """``protect``: checkpoint paths pruning must keep (the stability rollback target)."""
        t0 = time.perf_counter()
        try:
            return self._save(engine, batches, state, protect)
        finally:  # the loop stalls for the whole write + commit: measured for `bench --cluster`
            self.seconds += time.perf_counter() - t0
            self.count += 1

    def _save(self, engine, batches: TrainBatches, state: TrainerState, protect: set[str]) -> Path | None:
        cfg, ctx = self.cfg, self.ctx
        # Every rank checks its shard before anything is staged: a NaN/Inf checkpoint is never written.
        if dist.all_reduce_sum([nonfinite_params(engine)], ctx.device)[0] > 0:
            raise NonFiniteWeightsError(f"step {state.step}: non-finite weights, checkpoint not written")
        nonce = dist.broadcast_object(ckpt_io.new_nonce() if ctx.is_main else None)
        stage = ckpt_io.staging_dir(self.run_dir, state.step, nonce)
        stage.mkdir(parents=True, exist_ok=True)
        engine.save_checkpoint(str(stage / ckpt_io.DS_DIR), tag=ckpt_io.DS_TAG, save_latest=False)
        data_state = batches.state_dict()
        ckpt_io.save_rank_state(stage, ctx.rank, data_state, {"torch": torch.get_rng_state()})
        if ctx.is_main:
            (stage / "config.yaml").write_text(dump_yaml(cfg))
            ckpt_io.write_json(stage / "trainer_state.json", asdict(state))
            shutil.copytree(cfg.data.tokenizer, stage / "tokenizer")
        dist.barrier()
        final, error = None, None
        if ctx.is_main:
            manifest = {
                "run_id": self.tracker.run_id, "tokens_seen": state.tokens_seen,
                "config_hash": config_hash(cfg), "model_kind": cfg.model.kind,
                "moe_ep_size": cfg.moe.ep_size if cfg.moe.enabled else 0,
                "data_position": {"global_sequences": state.sequences,
                                  "num_streams": cfg.data.num_streams},
                "rng": {"scheme": "torch.manual_seed(crc32(seed:step:rank)) each step",
                        "states": "rng/rank_R.pt"},
                "metrics": {"train/loss": state.last_train_loss, **state.last_val},
            }
            try:
                final = ckpt_io.commit(stage, self.run_dir, state.step, manifest, ctx.world_size)
                self.tracker.register_checkpoint(final, ckpt_io.read_manifest(final))
                _prune(self.run_dir, cfg.checkpoint.keep_last, protect)
            except Exception as e:  # tell the other ranks instead of leaving them in a barrier
                error = f"{type(e).__name__}: {e}"
        # Every rank learns the committed path: the stability state (rollback targets) must be identical.
        error, final = dist.broadcast_object((error, final))
        if error:
            raise ckpt_io.CheckpointError(f"checkpoint at step {state.step} failed: {error}")
        return final


def check_expert_layout(ckpt: ckpt_io.CommittedCheckpoint, cfg: RunConfig, world_size: int) -> None:
    """Expert-parallel state resumes only into the same layout: DeepSpeed partitions the experts' ZeRO state
    over the expert-data-parallel group, which changes with ``moe.ep_size`` and the worker count."""
    saved_ep = int(ckpt.manifest.get("moe_ep_size", 0))
    saved_world = int(ckpt.manifest.get("world_size", world_size))
    ep = cfg.moe.ep_size if cfg.moe.enabled else 0
    if max(saved_ep, ep) <= 1:
        return  # dense or ep_size 1: experts are ordinary data-parallel weights, any worker count works
    if saved_ep != ep or saved_world != world_size:
        raise ckpt_io.CheckpointError(
            f"{ckpt.path}: saved with moe.ep_size={saved_ep} on {saved_world} workers; resuming expert-parallel "
            f"state needs the same layout (got moe.ep_size={ep} on {world_size} workers). Resume with "
            f"moe.ep_size={saved_ep} cluster.num_workers={saved_world}")


def _engine_state_dir(ckpt: ckpt_io.CommittedCheckpoint, run_dir: Path, ctx: dist.DistContext) -> Path | None:
    """None when the checkpoint's worker count matches; otherwise the directory of its DeepSpeed
    universal form (ZeRO state re-sharded for the new worker count), converted once by rank 0."""
    saved_world = int(ckpt.manifest.get("world_size", ctx.world_size))
    if saved_world == ctx.world_size:
        return None
    error, path = None, None
    if ctx.is_main:
        print(f"[train] elastic resume: {saved_world} -> {ctx.world_size} workers, converting the ZeRO "
              f"state to a DeepSpeed universal checkpoint", flush=True)
        try:
            path = ckpt_io.universal_checkpoint(ckpt, run_dir)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"{ckpt.path}: cannot re-shard from {saved_world} to {ctx.world_size} workers ({e})"
    error, path = dist.broadcast_object((error, path))
    if error:
        raise ckpt_io.CheckpointError(error)
    return path


def _prune(run_dir: Path, keep_last: int, protect: set[str]) -> None:
    """Delete committed checkpoints beyond the newest ``keep_last``, never one in ``protect``."""
    if keep_last <= 0:
        return
    for c in ckpt_io.list_committed(run_dir)[:-keep_last]:
        if str(c.path) not in protect:
            shutil.rmtree(c.path, ignore_errors=True)


def load_engine_state(engine, ckpt: ckpt_io.CommittedCheckpoint, universal_dir: Path | None) -> None:
    """Model and optimizer state from ``ckpt`` (its DeepSpeed universal form when the world size changed)."""
    engine._config.load_universal_checkpoint = universal_dir is not None  # DeepSpeed reads it at load time
    load_dir = universal_dir or ckpt.path / ckpt_io.DS_DIR
    load_path, _ = engine.load_checkpoint(str(load_dir), tag=ckpt_io.DS_TAG, load_module_strict=True)
    if load_path is None:
        raise ckpt_io.CheckpointError(f"{ckpt.path}: DeepSpeed could not load the engine state")


def _restore(engine, batches: TrainBatches, ckpt: ckpt_io.CommittedCheckpoint, ctx: dist.DistContext,
             universal_dir: Path | None) -> TrainerState:
    load_engine_state(engine, ckpt, universal_dir)
    data_state, rng = ckpt_io.load_rank_state(ckpt.path, ctx.rank)
    batches.load_state_dict(data_state)  # the union of all ranks' streams: any worker count works
    if rng is not None and universal_dir is None:
        torch.set_rng_state(rng["torch"])
    raw = json.loads((ckpt.path / "trainer_state.json").read_text())
    if "sequences" not in raw:  # written before stability control: no rollback ever moved the data
        raw["sequences"] = int(ckpt.manifest.get("data_position", {}).get("global_sequences", 0))
    return TrainerState(**raw)


def train_loop(job: dict[str, Any]) -> dict[str, Any]:
    """Train per ``job`` (a ``Job`` as dict). Returns the final metrics (rank 0's view)."""
    job_ = Job(**job)
    cfg = from_dict(job_.config)
    ctx = dist.setup(cfg.cluster.use_gpu)
    # Divide the node's CPUs among its local workers (Ray would otherwise leave one thread each).
    threads = cfg.train.num_threads or max(1, _cpu_count() // ctx.local_world_size)
    torch.set_num_threads(threads)
    cfg.check_world_size(ctx.world_size)
    run_dir = Path(job_.run_dir)
    tracker = Tracker(job_.tracking_uri if ctx.is_main else "", job_.run_id)
    progress = Progress(cfg.train.max_steps, 0, cfg.train.global_batch_size * cfg.model.max_seq_len, ctx.is_main)

    precision = resolve_precision(cfg.train.precision, ctx.device)
    tokenizer = load_or_train_tokenizer(cfg.data)
    model = build_model(cfg.model, cfg.train.seed, cfg.moe, ctx.rank)
    if cfg.model.init_from_hf:  # a resumed checkpoint, if any, overwrites these weights below
        from pretrain.export.hf import import_hf

        model.load_state_dict(import_hf(cfg.model.init_from_hf, max_seq_len=cfg.model.max_seq_len)[1])
    model.activation_checkpointing = cfg.train.activation_checkpointing
    model.to(ctx.device)
    if ctx.is_main:
        ckpt_io.cleanup_staging(run_dir)
    dist.barrier()
    resume = ckpt_io.latest_committed(run_dir)  # a restart (Ray failure handling) or `resume RUN_ID`
    if resume is None and cfg.checkpoint.resume_from:
        resume = ckpt_io.resolve(Path(cfg.checkpoint.resume_from))
    if resume is not None:
        ckpt_io.verify(resume.path, resume.manifest)
        check_expert_layout(resume, cfg, ctx.world_size)
    universal_dir = _engine_state_dir(resume, run_dir, ctx) if resume is not None else None
    engine = initialize(model, param_groups(model, cfg.train.weight_decay), cfg, ctx.world_size, precision,
                        load_universal=universal_dir is not None)
    data_kw = dict(kind=cfg.model.kind, seq_len=cfg.model.max_seq_len, tokenizer=tokenizer,
                   rank=ctx.rank, world_size=ctx.world_size)
    batches = TrainBatches(cfg.data, global_batch_size=cfg.train.global_batch_size, seed=cfg.train.seed, **data_kw)
    val_set = validation_batches(cfg.data, val_sequences=cfg.train.val_sequences,
                                 micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, **data_kw)
    # Every rank must run the same number of validation forwards (ZeRO-3 forwards are collective).
    val_set = val_set[:int(dist.all_reduce_min([len(val_set)], ctx.device)[0])]

    state = TrainerState()
    if resume is not None:
        state = _restore(engine, batches, resume, ctx, universal_dir)
        progress = Progress(cfg.train.max_steps, state.step, progress.tokens_per_step, ctx.is_main)
        progress.say(f"resumed from {resume.path} (step {state.step}, {state.tokens_seen:,} tokens)")
    progress.say(f"{ctx.world_size} worker(s), device {ctx.device.type}, {precision}, ZeRO-{cfg.zero.stage}, "
                 f"{threads} thread(s)/worker, grad accum {cfg.grad_accum_steps(ctx.world_size)}")

    checkpointer = Checkpointer(cfg, run_dir, ctx, tracker)
    last_ckpt: Path | None = resume.path if resume is not None else None
    t = cfg.train
    window: list[float] = []
    micro_ids = micro_batch_ids(ctx.rank, ctx.world_size, t.global_batch_size, t.micro_batch_size,
                                cfg.data.num_streams)
    control = StabilityControl(cfg, state, ctx, run_dir, tracker, progress)
    if resume is not None:
        control.monitor.note_checkpoint(resume.step, str(resume.path), state.sequences)

    validated_at = -1
    moe_metrics: dict[str, float] = {}  # routing metrics of the last logged step

    def run_validation() -> None:
        nonlocal validated_at
        if not val_set or validated_at == state.step:
            return
        validated_at = state.step
        state.last_val = evaluate(engine, val_set, cfg.model.kind, ctx.device)
        tracker.log_metrics(state.last_val, state.step)
        progress.say(f"step {state.step} validation: " + ", ".join(f"{k} {v:.4f}" for k, v in state.last_val.items()))

    def save_checkpoint() -> None:
        nonlocal last_ckpt
        state.stability = control.monitor.state_dict()
        try:
            saved = checkpointer.save(engine, batches, state, control.monitor.protected_paths())
        except NonFiniteWeightsError:
            act(control.monitor.nonfinite_weights(state.step))
            return
        if saved is not None:
            last_ckpt = saved
            control.monitor.note_checkpoint(state.step, str(saved), state.sequences)
        progress.say(f"checkpoint committed: step {state.step}")

    def act(decision: Decision) -> bool:
        """Carry out a decision's side effects; True when the loop must restart from a rollback."""
        nonlocal last_ckpt
        if decision.event is not None:
            control.report(decision.event, decision.action != "log")
        if decision.action == "halt":
            raise control.halt(decision.event)
        if decision.action == "rollback":
            last_ckpt = control.rollback(
                lambda c: load_engine_state(engine, c, _engine_state_dir(c, run_dir, ctx)), decision.event["step"])
            return True
        return False

    while state.step < t.max_steps:
        torch.manual_seed(step_seed(t.seed, state.step, ctx.rank))
        batch = _next_batch(batches, cfg, ctx)
        if batch is None:
            progress.say(f"data exhausted at step {state.step} (data.repeat=false): stopping")
            break
        step_no = state.step + 1
        _maybe_kill_worker(cfg, ctx, run_dir, step_no)
        lr = lr_at(state.step, t) * control.monitor.lr_factor(step_no)
        if control.fault("loss_spike", cfg.faults.loss_spike_at_step, step_no):
            lr *= SPIKE_LR_FACTOR
        nan_fault = control.fault("nan_grad", cfg.faults.nan_grad_at_step, step_no)  # recorded on every rank
        corrupt = nan_fault and ctx.rank == min(1, ctx.world_size - 1)  # ... but poisons one rank only
        health_step = bool(cfg.stability.health_every) and step_no % cfg.stability.health_every == 0
        seeds = [step_seed(t.seed, state.step, mid) for mid in micro_ids]
        t0 = time.perf_counter()
        result = run_step(engine, batch, t.micro_batch_size, lr, ctx.device, seeds, step=step_no,
                          guard=control.monitor.decide, probe=HealthProbe(engine) if health_step else None,
                          corrupt_grads=corrupt)
        progress.add_step(time.perf_counter() - t0)
        loss, gnorm = result.loss, result.grad_norm
        control.record(step_no, loss, gnorm)
        for event in control.monitor.router_collapse(step_no, max_shares(result.moe)) if result.moe else ():
            control.report(event, urgent=False)
        state.step += 1
        state.tokens_seen += progress.tokens_per_step
        state.sequences += t.global_batch_size
        state.last_train_loss = loss
        if result.health:
            control.log({**result.health, "health/steps_since_event": float(
                control.monitor.steps_since_event(state.step))}, state.step)
        if result.decision is not None and result.decision.event is not None:  # the plot shows the spike
            tracker.log_metrics({"train/loss": loss, "train/grad_norm": gnorm}, state.step)
        if act(result.decision):
            continue
        if math.isfinite(loss):
            window.append(loss)
        last = state.step == t.max_steps
        if state.step % t.log_every == 0 or last:
            metrics = {"train/loss": loss, "train/lr": lr, "train/grad_norm": gnorm,
                       "train/tokens_per_s": progress.window_tokens_per_s(),
                       "train/tokens_seen": float(state.tokens_seen),
                       "train/loss_avg": sum(window) / len(window) if window else float("nan"),
                       **control.monitor.counters()}
            window.clear()
            progress.line(state.step, metrics)
            tracker.log_metrics(metrics, state.step)
            if result.moe:
                moe_metrics = routing_metrics(result.moe)
                control.log(moe_metrics, state.step)
            control.flush()
        if last or (t.val_every and state.step % t.val_every == 0):
            run_validation()
        if last or (cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0):
            save_checkpoint()
        if state.step == cfg.faults.stop_after_step and not last:
            progress.say(f"stopping after step {state.step} (faults.stop_after_step)")
            break
    if state.step < t.max_steps and state.step > 0:  # stopped early: still validate and commit
        run_validation()
        if last_ckpt is None or not last_ckpt.name.endswith(f"{state.step:08d}"):
            save_checkpoint()

    bad = batches.bad_record_summary()
    bad["total"] = int(dist.all_reduce_sum([float(bad.get("total", 0))], ctx.device)[0])  # all streams
    final: dict[str, Any] = {
        "step": state.step, "tokens_seen": state.tokens_seen, "final_train_loss": state.last_train_loss,
        "tokens_per_s": progress.tokens_per_s(), "bad_records": int(bad.get("total", 0)),
        "train_seconds": progress.train_seconds, "checkpoint_seconds": checkpointer.seconds,
        "checkpoints": checkpointer.count,
        "checkpoint": str(last_ckpt) if last_ckpt else "", "run_id": job_.run_id,
        **{k.replace("/", "_"): v for k, v in state.last_val.items()},
        "stability": control.monitor.summary(),
        **({"moe": moe_metrics} if moe_metrics else {}),
    }
    if ctx.is_main:
        if val_set:
            final["unigram_val_loss"] = unigram_baseline_loss(
                cfg.data, kind=cfg.model.kind, seq_len=cfg.model.max_seq_len, tokenizer=tokenizer,
                val_sequences=cfg.train.val_sequences, seed=cfg.train.seed)
            tracker.log_metrics({"val/unigram_baseline_loss": final["unigram_val_loss"]}, state.step)
        if bad.get("total"):
            progress.say(f"bad records skipped: {bad['total']} {bad.get('by_reason', {})}; "
                         f"first: {'; '.join(bad.get('examples', [])[:3])}")
        tracker.log_metrics({"data/bad_records": float(bad.get("total", 0))}, state.step)
        tracker.log_json(bad, "data/bad_records.json")
        control.flush(force=True)
        if cfg.stability.plot_at_end:
            final["plot"] = control.plot(job_.tracking_uri)
        tracker.log_json(final, "summary.json")
        ckpt_io.write_json(run_dir / SUMMARY_FILE, final)
    return final


def _next_batch(batches: TrainBatches, cfg: RunConfig, ctx: dist.DistContext) -> dict | None:
    """This rank's share of the next global batch, or None when any rank's data ran out."""
    if cfg.data.repeat:  # streams restart: no rank can run dry, no extra collective per step
        return batches.next_step()
    try:
        batch, exhausted = batches.next_step(), 0.0
    except StopIteration:
        batch, exhausted = None, 1.0
    return None if dist.all_reduce_sum([exhausted], ctx.device)[0] > 0 else batch


def _maybe_kill_worker(cfg: RunConfig, ctx: dist.DistContext, run_dir: Path, step: int) -> None:
    """Fault hook ``faults.kill_worker_at_step``: rank 1 (rank 0 alone) SIGKILLs itself once, at ``step``.
    A marker in the run directory makes it once per run, across restarts."""
    if cfg.faults.kill_worker_at_step != step or ctx.rank != min(1, ctx.world_size - 1):
        return
    marker = run_dir / ".faults" / f"killed_at_step_{step}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {ctx.rank} pid {os.getpid()}\n")
    print(f"[fault] rank {ctx.rank} kills itself with SIGKILL at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
