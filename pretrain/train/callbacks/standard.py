"""The callbacks of a training run, declared in one place: :data:`STANDARD`, one :class:`Slot` per callback in
ascending ``order`` (each class declares its own, see :mod:`pretrain.train.callbacks.base`; equal orders run in the
order of the table), each built when the feature it serves is enabled. :func:`standard_callbacks` assembles the set.

=====  ====================  ===========================================================================
order  callback              what it does (module; when the config enables it)
=====  ====================  ===========================================================================
0      SpeedMonitor          times each step (tokens/s excludes validation and checkpoints; speed.py)
1      ProfilerCallback      the torch profiler over a window of steps (profiler.py; ``train.profile_at``)
2      SystemMetrics         MLflow's ``system/*`` metrics on rank 0 (system_metrics.py; ``tracking.system_metrics``)
2      ThroughputMonitor     ``train/mfu``, ``train/data_wait_frac`` (utilization.py)
2      MemoryMonitor         peak memory per rank, ``sys/*`` (memory.py; collective at logged steps)
3      GrowthCallback        grows the model, rebuilds the module (growth.py; ``growth.schedule`` or a re-warm)
5      LayerDropCallback     the gates of every training forward (layer_drop.py; ``layer_drop``)
6      EarlyExitCallback     the early exits of every training forward, ``val/exit_<E>/*`` after each validation
                             (early_exit.py; ``layer_drop.early_exit``)
10     StabilityCallback     decides each update (skip / roll back / halt), records events, LR cool-down (stability.py)
15     HealthCallback        health probes on ``stability.health_every`` steps, logged to MLflow (health.py)
20     FaultInjection        ``faults.*`` hooks: kill a worker, NaN gradient, LR spike, stop (fault_injection.py)
30     MetricsLogger         progress line and MLflow metrics every ``train.log_every`` steps (metrics.py)
40     ValidationCallback    validation every ``train.val_every`` steps and at the end (validation.py)
41     SourceValidation      ``val/<source>/*`` after each validation (source_validation.py)
42     TaskEvaluation        ``eval.tasks`` every ``eval.every`` steps (task_evaluation.py)
45     EarlyStop             ``train.stop_at_val_loss``: ends the run at a good enough validation (stopping.py)
46     StopOnRequest         a stop the driver asked for (signal, ``stop JOB``): ends the run after this step
                             (stopping.py)
50     CheckpointCallback    committed checkpoints every ``checkpoint.every_steps`` and at the end (checkpoint.py)
55     CheckpointStats       bytes and seconds each rank hashed for checkpoints (checkpoint_stats.py)
100    DataFingerprint       the data sources' fingerprint in every checkpoint (data_fingerprint.py)
190    StabilityReport       stability summary, timeline and plot at the end of the run (stability.py)
200    RunSummary            bad-record totals, unigram baseline, ``summary.json`` (MLflow and the run dir;
                             run_summary.py)
=====  ====================  ===========================================================================

``tests/unit/train/callbacks/test_standard.py`` checks this table (and the one in ``docs/architecture.md``)
against :data:`STANDARD`, and that the table is sorted by each class's ``order``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.checkpoint.hash_tally import HashTally
from pretrain.config import RunConfig, RunPlan
from pretrain.train.callbacks.base import Callback
from pretrain.train.callbacks.checkpoint import CheckpointCallback
from pretrain.train.callbacks.checkpoint_stats import CheckpointStats
from pretrain.train.callbacks.data_fingerprint import DataFingerprint
from pretrain.train.callbacks.early_exit import EarlyExitCallback
from pretrain.train.callbacks.fault_injection import FaultInjection
from pretrain.train.callbacks.growth import GrowthCallback
from pretrain.train.callbacks.health import HealthCallback
from pretrain.train.callbacks.layer_drop import LayerDropCallback
from pretrain.train.callbacks.memory import MemoryMonitor
from pretrain.train.callbacks.metrics import MetricsLogger
from pretrain.train.callbacks.profiler import ProfilerCallback
from pretrain.train.callbacks.run_summary import RunSummary
from pretrain.train.callbacks.source_validation import SourceValidation
from pretrain.train.callbacks.speed import SpeedMonitor
from pretrain.train.callbacks.stability import StabilityCallback, StabilityReport
from pretrain.train.callbacks.stopping import EarlyStop, StopOnRequest
from pretrain.train.callbacks.system_metrics import SystemMetrics
from pretrain.train.callbacks.task_evaluation import PreparedTask, TaskEvaluation
from pretrain.train.callbacks.utilization import ThroughputMonitor
from pretrain.train.callbacks.validation import ValidationCallback
from pretrain.train.checkpointer import Checkpointer
from pretrain.train.stability.control import StabilityControl


@dataclass(frozen=True)
class RunParts:
    """What the callbacks of a run are built from (the worker's side of the run, see ``build_trainer``)."""

    cfg: RunConfig
    control: StabilityControl
    checkpointer: Checkpointer
    tracking_uri: str
    plan: RunPlan
    rank: int
    run_id: str
    tokenizer: Any
    per_source: dict[str, list[dict[str, torch.Tensor]]]
    """The per-source validation sets (:class:`SourceValidation`)."""
    only_source: str
    """The single source whose set is the aggregate one (then ``per_source`` is empty)."""
    tasks: list[PreparedTask]
    """The prepared ``eval.tasks``."""
    hashed_at_setup: HashTally
    """The hash tally when the worker started (:class:`CheckpointStats`)."""
    data_fingerprint: dict[str, Any]
    """The fingerprint of the run's data sources, taken by the driver (:class:`DataFingerprint`)."""
    byte_lengths: torch.Tensor | None = None
    """Decoders: UTF-8 bytes of every token id, for ``val/bits_per_byte``."""


def _always(cfg: RunConfig) -> bool:
    return True


@dataclass(frozen=True)
class Slot:
    """One callback of the standard set: its class, how it is built, and when (``enabled``: from the config)."""

    cls: type[Callback]
    build: Callable[[RunParts], Callback]
    enabled: Callable[[RunConfig], bool] = _always


STANDARD: tuple[Slot, ...] = (
    Slot(SpeedMonitor, lambda p: SpeedMonitor()),
    Slot(
        ProfilerCallback,
        lambda p: ProfilerCallback(p.cfg.train.profile_at, p.cfg.train.profile_steps),
        lambda cfg: bool(cfg.train.profile_at),
    ),
    Slot(SystemMetrics, lambda p: SystemMetrics(), lambda cfg: bool(cfg.tracking.system_metrics)),
    Slot(ThroughputMonitor, lambda p: ThroughputMonitor()),
    Slot(MemoryMonitor, lambda p: MemoryMonitor()),
    Slot(
        GrowthCallback,
        lambda p: GrowthCallback(p.cfg),
        lambda cfg: bool(cfg.growth.schedule) or cfg.growth.rewarm_steps > 0,  # also the re-warm after `grow`
    ),
    Slot(
        LayerDropCallback,
        lambda p: LayerDropCallback(p.cfg, p.rank, p.plan.micro_batch_ids(p.rank)),
        lambda cfg: bool(cfg.layer_drop.enabled),
    ),
    Slot(EarlyExitCallback, lambda p: EarlyExitCallback(p.cfg), lambda cfg: cfg.layer_drop.early_exit.enabled),
    Slot(StabilityCallback, lambda p: StabilityCallback(p.control)),
    Slot(HealthCallback, lambda p: HealthCallback(p.cfg.stability.health_every)),
    Slot(FaultInjection, lambda p: FaultInjection(p.cfg)),
    Slot(MetricsLogger, lambda p: MetricsLogger()),
    Slot(ValidationCallback, lambda p: ValidationCallback(p.byte_lengths)),
    Slot(SourceValidation, lambda p: SourceValidation(p.per_source, p.only_source, p.byte_lengths)),
    Slot(TaskEvaluation, lambda p: TaskEvaluation(p.tasks, p.cfg.eval.every)),
    Slot(EarlyStop, lambda p: EarlyStop(p.cfg.train.stop_at_val_loss)),
    Slot(StopOnRequest, lambda p: StopOnRequest()),
    Slot(CheckpointCallback, lambda p: CheckpointCallback(p.checkpointer)),
    Slot(CheckpointStats, lambda p: CheckpointStats(p.hashed_at_setup)),
    Slot(DataFingerprint, lambda p: DataFingerprint(p.data_fingerprint)),
    Slot(StabilityReport, lambda p: StabilityReport(p.control, p.tracking_uri)),
    Slot(RunSummary, lambda p: RunSummary(p.tokenizer, p.run_id)),
)
"""The standard set in ascending ``order`` (ties: the order here); the module docstring's table lists it."""


def standard_callbacks(parts: RunParts) -> list[Callback]:
    """The callbacks of a training run: every slot of :data:`STANDARD` whose feature ``parts.cfg`` enables, in
    ascending ``order`` (equal orders in the order of :data:`STANDARD`)."""
    built = [slot.build(parts) for slot in STANDARD if slot.enabled(parts.cfg)]
    return sorted(built, key=lambda cb: cb.order)
