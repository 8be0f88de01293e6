"""The trainer's standard callbacks: speed, stability actions, health probes, metrics and progress, validation,
checkpoints, and test-only fault injection. Each does one thing; ``order`` fixes who runs first.

=====  ====================  ===========================================================================
order  callback              what it does
=====  ====================  ===========================================================================
0      SpeedMonitor          times each step (tokens/s excludes validation and checkpoints)
2      ThroughputMonitor     ``train/mfu``, ``train/data_wait_frac`` (monitors.py)
2      MemoryMonitor         peak memory per rank, ``sys/*`` (monitors.py; collective at logged steps)
3      GrowthCallback        ``growth.schedule``: grows the model (rebuilds the module) at the given steps
5      LayerDropCallback     ``layer_drop``: the gates of every training forward
10     StabilityCallback     decides each update (skip / roll back / halt), records events, LR cool-down
15     HealthCallback        health probes on ``stability.health_every`` steps, logged to MLflow
20     FaultInjection        ``faults.*`` hooks (kill a worker, NaN gradient, LR spike, stop early)
30     MetricsLogger         progress line and MLflow metrics every ``train.log_every`` steps
40     ValidationCallback    validation every ``train.val_every`` steps and at the end
41     SourceValidation      ``val/<source>/*`` after each validation (evaluators.py; added by the loop)
42     TaskEvaluation        ``eval.tasks`` every ``eval.every`` steps (evaluators.py; added by the loop)
45     EarlyStop             ``train.stop_at_val_loss``: ends the run at a good enough validation
50     CheckpointCallback    committed checkpoints every ``checkpoint.every_steps`` and at the end
190    StabilityReport       stability summary, timeline and plot at the end of the run
200    RunSummary            bad-record totals, unigram baseline, ``summary.json`` (MLflow and the run dir)
=====  ====================  ===========================================================================

Feature callbacks (e.g. growth, layer dropout, ``train.profile_at``: ProfilerCallback at order 1) are added by
:func:`standard_callbacks` when their config section enables them.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint import layout
from pretrain.checkpoint.store import write_json
from pretrain.config import RunConfig, RunPlan
from pretrain.model.moe import max_shares, routing_metrics
from pretrain.train import dist
from pretrain.train.checkpointing import Checkpointer, NonFiniteWeightsError
from pretrain.train.growth import GrowthCallback
from pretrain.train.health import HealthProbe
from pretrain.train.layer_drop import LayerDropCallback
from pretrain.train.monitors import MemoryMonitor, SystemMetrics, ThroughputMonitor
from pretrain.train.profiling import ProfilerCallback
from pretrain.train.resume import rollback_loader
from pretrain.train.stability import Decision, StabilityControl
from pretrain.train.step import StepResult, evaluate
from pretrain.train.timing import SpeedMonitor  # noqa: F401  (a standard callback; defined with the loop clock)
from pretrain.train.trainer import Callback, Trainer

SPIKE_LR_FACTOR = 1000.0  # faults.loss_spike_at_step
SUMMARY_FILE = layout.SUMMARY


def _last(trainer: Trainer) -> bool:
    return trainer.state.step == trainer.cfg.train.max_steps


def _stopped_early(trainer: Trainer) -> bool:
    return 0 < trainer.state.step < trainer.cfg.train.max_steps


class StabilityCallback(Callback):
    """The stability guard of every update and the actions of its decisions (see ``stability.py``). Publishes the
    step of the latest event (``trainer.shared.last_event_step``) and keeps its rollback target from pruning."""

    order = 10
    name = "stability"

    def __init__(self, control: StabilityControl) -> None:
        self.control = control
        self.monitor = control.monitor

    def on_run_start(self, trainer: Trainer) -> None:
        if trainer.last_checkpoint is not None:  # resumed: that checkpoint is a rollback candidate
            self.monitor.note_checkpoint(trainer.state.step, str(trainer.last_checkpoint), trainer.state.sequences)
        trainer.shared.last_event_step = self.monitor.s.last_event_step

    def lr_factor(self, step: int) -> float:
        return self.monitor.lr_factor(step)

    def decide(self, signals):
        return self.monitor.decide(signals)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        step = trainer.state.step
        self.control.record(step, result.loss, result.grad_norm)
        for event in self.monitor.router_collapse(step, max_shares(result.moe)) if result.moe else ():
            self.control.report(event, urgent=False)
        trainer.shared.last_event_step = self.monitor.s.last_event_step
        if result.decision is not None and result.decision.event is not None:  # the plot shows the spike
            trainer.tracker.log_metrics({"train/loss": result.loss, "train/grad_norm": result.grad_norm}, step)
        if self.act(trainer, result.decision):
            trainer.end_step()
            return
        if step % trainer.cfg.train.log_every == 0 or _last(trainer):
            self.control.flush()

    def on_model_changed(self, trainer: Trainer) -> None:
        self.monitor.restart()  # no rollback across a growth; spike statistics of the new model only

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        self.monitor.note_checkpoint(trainer.state.step, str(path), trainer.state.sequences)

    def on_nonfinite_weights(self, trainer: Trainer, step: int) -> None:
        self.act(trainer, self.monitor.nonfinite_weights(step))

    def act(self, trainer: Trainer, decision: Decision | None) -> bool:
        """Carry out a decision's side effects; True when it rolled back (the step's remaining events are void)."""
        if decision is None:
            return False
        if decision.event is not None:
            self.control.report(decision.event, decision.action != "log")
        if decision.action == "halt":
            raise self.control.halt(decision.event)
        if decision.action == "rollback":
            trainer.emit("on_rollback")  # a save in flight is committed first (its target may be that one)
            trainer.last_checkpoint = self.control.rollback(
                rollback_loader(trainer.module, trainer.run_dir, trainer.ctx), decision.event["step"])
            return True
        return False

    def extra_metrics(self) -> dict[str, float]:
        return self.monitor.counters()

    def protected_paths(self) -> set[str]:
        return self.monitor.protected_paths()

    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state)


class StabilityReport(Callback):
    """At the end: the stability summary in the result, the timeline flushed, the plot drawn (rank 0)."""

    order = 190

    def __init__(self, control: StabilityControl, tracking_uri: str) -> None:
        self.control, self.tracking_uri = control, tracking_uri

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        final["stability"] = self.control.monitor.summary()
        if trainer.ctx.is_main:
            self.control.flush(force=True)
            if trainer.cfg.stability.plot_at_end:
                final["plot"] = self.control.plot(self.tracking_uri)


class HealthCallback(Callback):
    """Health metrics (``stability.health_every``): probes the first micro-batch's forward and the update."""

    order = 15

    def __init__(self, every: int) -> None:
        self.every = every
        self.probe: HealthProbe | None = None
        self.health: dict[str, float] = {}

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        self.probe = HealthProbe(trainer.module.engine) if self.every and step % self.every == 0 else None
        self.health = {}

    def before_forward(self, module, index: int) -> None:
        if self.probe is not None and index == 0:
            self.probe.attach()

    def after_forward(self, module, index: int, output) -> None:
        if self.probe is not None and index == 0:
            self.probe.detach(output)

    def before_update(self, module) -> None:
        if self.probe is not None:
            self.probe.before_update()

    def after_update(self, module) -> None:
        if self.probe is not None:
            self.probe.after_update()
            self.health = self.probe.reduce(module.device)  # collective

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if not self.health:
            return
        since = max(0, trainer.state.step - trainer.shared.last_event_step)
        health = self.health
        skipped = [f"block{i:02d}" for i in sorted(trainer.shared.skipped_blocks)]
        if skipped:  # per-layer metrics count executed layers only
            health = {k: v for k, v in health.items() if not k.endswith(tuple(skipped))}
        trainer.tracker.log_metrics({**health, "health/steps_since_event": float(since)}, trainer.state.step)


class FaultInjection(Callback):
    """Test-only ``faults.*`` hooks; each fires once per run (the fired ones are saved in every checkpoint, so
    neither a rollback nor a resume replays them)."""

    order = 20
    name = "faults_fired"  # the top-level key of trainer_state.json before callbacks owned their state

    def __init__(self, cfg: RunConfig) -> None:
        self.faults = cfg.faults
        self.spike = self.poison = False
        self.fired: list[str] = []

    def state_dict(self) -> dict[str, Any]:
        return {"fired": list(self.fired)}

    def load_state_dict(self, state: dict[str, Any] | list[str]) -> None:
        self.fired = list(state["fired"] if isinstance(state, dict) else state)  # a list: an older checkpoint

    def _fire(self, trainer: Trainer, name: str, at_step: int, step: int) -> bool:
        if at_step != step or name in self.fired:
            return False
        self.fired.append(name)
        trainer.progress.say(f"[fault] {name} injected at step {step}")
        return True

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        ctx = trainer.ctx
        victim = ctx.rank == min(1, ctx.world_size - 1)
        if self.faults.kill_worker_at_step == step and victim:
            _kill_once(trainer.run_dir, ctx.rank, step)
        self.spike = self._fire(trainer, "loss_spike", self.faults.loss_spike_at_step, step)
        # Recorded on every rank, but poisons one rank's gradients only.
        self.poison = self._fire(trainer, "nan_grad", self.faults.nan_grad_at_step, step) and victim

    def lr_factor(self, step: int) -> float:
        return SPIKE_LR_FACTOR if self.spike else 1.0

    def objective(self, objective: torch.Tensor, index: int, count: int) -> torch.Tensor:
        return _NaNGrad.apply(objective) if self.poison and index == count - 1 else objective

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if trainer.state.step == self.faults.stop_after_step and not _last(trainer):
            trainer.progress.say(f"stopping after step {trainer.state.step} (faults.stop_after_step)")
            trainer.stop("faults.stop_after_step")


def _kill_once(run_dir: Path, rank: int, step: int) -> None:
    """SIGKILL this worker, once per run across restarts (a marker in the run directory)."""
    marker = run_dir / ".faults" / f"killed_at_step_{step}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {rank} pid {os.getpid()}\n")
    print(f"[fault] rank {rank} kills itself with SIGKILL at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class _NaNGrad(torch.autograd.Function):
    """Identity forward, NaN backward: fault injection that poisons this rank's gradients only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("nan"))


class MetricsLogger(Callback):
    """Every ``train.log_every`` steps (and the last): the progress line and ``train/*`` metrics (plus every
    callback's ``extra_metrics``) to MLflow, and the MoE routing metrics."""

    order = 30

    def __init__(self) -> None:
        self.window: list[float] = []
        self.moe_metrics: dict[str, float] = {}

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        if math.isfinite(result.loss):
            self.window.append(result.loss)
        step = trainer.state.step
        if step % trainer.cfg.train.log_every and not _last(trainer):
            return
        metrics = {"train/loss": result.loss, "train/lr": trainer.module.engine.optimizer.param_groups[0]["lr"],
                   "train/grad_norm": result.grad_norm,
                   "train/tokens_per_s": trainer.progress.window_tokens_per_s(),
                   "train/tokens_seen": float(trainer.state.tokens_seen),
                   "train/loss_avg": sum(self.window) / len(self.window) if self.window else float("nan")}
        for extra in trainer.gather("extra_metrics"):
            metrics.update(extra)
        self.window.clear()
        trainer.progress.line(step, metrics)
        trainer.tracker.log_metrics(metrics, step)
        if result.moe:
            self.moe_metrics = routing_metrics(result.moe)
            trainer.tracker.log_metrics(self.moe_metrics, step)

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        if self.moe_metrics:
            final["moe"] = self.moe_metrics


class ValidationCallback(Callback):
    """Validation every ``train.val_every`` steps, at the last step, and when a run stops early."""

    order = 40

    def __init__(self, byte_lengths: torch.Tensor | None = None) -> None:
        self.validated_at = -1
        self.byte_lengths = byte_lengths  # decoders: val/bits_per_byte

    def run(self, trainer: Trainer) -> None:
        state = trainer.state
        if not trainer.val_set or self.validated_at == state.step:
            return
        self.validated_at = state.step
        state.last_val = evaluate(trainer.module, trainer.val_set, self.byte_lengths)
        trainer.tracker.log_metrics(state.last_val, state.step)
        trainer.progress.say(f"step {state.step} validation: "
                             + ", ".join(f"{k} {v:.4f}" for k, v in state.last_val.items()))
        trainer.emit("on_validation", state.last_val)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        every = trainer.cfg.train.val_every
        if _last(trainer) or (every and trainer.state.step % every == 0):
            self.run(trainer)

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        if _stopped_early(trainer):
            self.run(trainer)
        final.update({k.replace("/", "_"): v for k, v in trainer.state.last_val.items()})


class EarlyStop(Callback):
    """``train.stop_at_val_loss``: end the run at the first validation at or below the target."""

    order = 45  # after validation has run in a step's on_step_end

    def __init__(self, target: float) -> None:
        self.target = target

    def on_validation(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        if self.target and metrics["val/loss"] <= self.target and trainer.state.step < trainer.cfg.train.max_steps:
            trainer.progress.say(f"val/loss {metrics['val/loss']:.4f} <= train.stop_at_val_loss {self.target}: stopping")
            trainer.stop("train.stop_at_val_loss")


class CheckpointCallback(Callback):
    """Checkpoints every ``checkpoint.every_steps``, at the last step, and when a run stops early. An asynchronous
    save (``checkpoint.async``) is committed at the first step boundary after every rank has written it, before a
    stability rollback, before the next save, and at the end of the run."""

    order = 50

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer

    def save(self, trainer: Trainer) -> None:
        # At most one save in flight: the one still in flight (its commit slower than the steps since) is
        # committed first, and said, before this one starts.
        self.committed(trainer, self.checkpointer.finish())
        trainer.collect_state()
        try:
            path = self.checkpointer.save(trainer.module, trainer.batches, trainer.state,
                                          lambda: set().union(*trainer.gather("protected_paths")))
        except NonFiniteWeightsError:
            trainer.emit("on_nonfinite_weights", trainer.state.step)
            return
        if self.checkpointer.in_flight is None:  # synchronous: committed already
            self.committed(trainer, path)
        trainer.emit("on_checkpoint", path)  # its state is fixed: a rollback target once it proves good

    def committed(self, trainer: Trainer, path: Path | None) -> None:
        if path is not None:
            trainer.last_checkpoint = path
            trainer.progress.say(f"checkpoint committed: step {layout.step_of(path.name)}")

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self.checkpointer.warm(trainer.module)
        self.committed(trainer, self.checkpointer.poll())
        every = trainer.cfg.checkpoint.every_steps
        if _last(trainer) or (every and trainer.state.step % every == 0):
            self.save(trainer)

    def on_rollback(self, trainer: Trainer) -> None:
        self.committed(trainer, self.checkpointer.finish())

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        self.committed(trainer, self.checkpointer.finish())
        last = trainer.last_checkpoint
        if _stopped_early(trainer) and (last is None or not last.name.endswith(f"{trainer.state.step:08d}")):
            self.save(trainer)
            self.committed(trainer, self.checkpointer.finish())
        self.checkpointer.writer.settle()  # pruned checkpoints deleted before the run ends
        final.update(self.checkpointer.summary(),
                     checkpoint=str(trainer.last_checkpoint) if trainer.last_checkpoint else "")


class RunSummary(Callback):
    """The end of the run: bad-record totals over all ranks (collective), then on rank 0 the unigram baseline of
    the validation set and the summary (MLflow ``summary.json`` and ``RUN_DIR/summary.json``)."""

    order = 200  # last: the summary holds what every other callback added to ``final``

    def __init__(self, tokenizer, run_id: str):
        self.tokenizer, self.run_id = tokenizer, run_id

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        from pretrain.data import unigram_baseline_loss

        cfg, ctx, tracker, step = trainer.cfg, trainer.ctx, trainer.tracker, trainer.state.step
        final["run_id"] = self.run_id
        bad = trainer.batches.bad_record_summary()
        bad["total"] = int(dist.all_reduce_sum([float(bad.get("total", 0))], ctx.device)[0])  # all streams
        final["bad_records"] = int(bad.get("total", 0))
        if not ctx.is_main:
            return
        if trainer.val_set:
            final["unigram_val_loss"] = unigram_baseline_loss(
                cfg.data, kind=cfg.model.kind, seq_len=cfg.model.max_seq_len, tokenizer=self.tokenizer,
                val_sequences=cfg.train.val_sequences, seed=cfg.train.seed)
            tracker.log_metrics({"val/unigram_baseline_loss": final["unigram_val_loss"]}, step)
        if bad.get("total"):
            trainer.progress.say(f"bad records skipped: {bad['total']} {bad.get('by_reason', {})}; "
                                 f"first: {'; '.join(bad.get('examples', [])[:3])}")
        tracker.log_metrics({"data/bad_records": float(bad.get("total", 0))}, step)
        tracker.log_json(bad, "data/bad_records.json")
        tracker.log_json(final, SUMMARY_FILE)
        write_json(Path(trainer.run_dir) / SUMMARY_FILE, final)


def standard_callbacks(trainer_cfg: RunConfig, control: StabilityControl, checkpointer: Checkpointer,
                       tracking_uri: str, plan: RunPlan, rank: int,
                       byte_lengths: torch.Tensor | None = None) -> list[Callback]:
    """The callbacks of a training run: the standard ones, plus those of the enabled features. ``byte_lengths``
    (decoders): UTF-8 bytes of every token id, for ``val/bits_per_byte``."""
    features: list[Callback] = []
    if trainer_cfg.train.profile_at:
        features.append(ProfilerCallback(trainer_cfg.train.profile_at, trainer_cfg.train.profile_steps))
    if trainer_cfg.growth.schedule or trainer_cfg.growth.rewarm_steps:  # also the re-warm after `grow`
        features.append(GrowthCallback(trainer_cfg))
    if trainer_cfg.layer_drop.enabled:
        features.append(LayerDropCallback(trainer_cfg, rank, plan.micro_batch_ids(rank)))
    if trainer_cfg.tracking.system_metrics:
        features.append(SystemMetrics())
    return features + [SpeedMonitor(), ThroughputMonitor(), MemoryMonitor(), StabilityCallback(control), StabilityReport(control, tracking_uri),
            HealthCallback(trainer_cfg.stability.health_every), FaultInjection(trainer_cfg), MetricsLogger(),
            ValidationCallback(byte_lengths), EarlyStop(trainer_cfg.train.stop_at_val_loss), CheckpointCallback(checkpointer)]
