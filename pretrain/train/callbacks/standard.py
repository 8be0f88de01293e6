"""The standard callbacks of a training run, assembled in one place (:func:`standard_callbacks`), plus those of
the features the config enables.

=====  ====================  ===========================================================================
order  callback              what it does
=====  ====================  ===========================================================================
0      SpeedMonitor          times each step (tokens/s excludes validation and checkpoints; speed.py)
1      ProfilerCallback      ``train.profile_at``: the torch profiler over a window of steps (profiler.py)
2      ThroughputMonitor     ``train/mfu``, ``train/data_wait_frac`` (throughput.py)
2      MemoryMonitor         peak memory per rank, ``sys/*`` (memory.py; collective at logged steps)
3      GrowthCallback        ``growth.schedule``: grows the model (rebuilds the module) at the given steps
5      LayerDropCallback     ``layer_drop``: the gates of every training forward (layer_drop.py)
10     StabilityCallback     decides each update (skip / roll back / halt), records events, LR cool-down
15     HealthCallback        health probes on ``stability.health_every`` steps, logged to MLflow
20     FaultInjection        ``faults.*`` hooks (kill a worker, NaN gradient, LR spike, stop early)
30     MetricsLogger         progress line and MLflow metrics every ``train.log_every`` steps
40     ValidationCallback    validation every ``train.val_every`` steps and at the end
41     SourceValidation      ``val/<source>/*`` after each validation
42     TaskEvaluation        ``eval.tasks`` every ``eval.every`` steps
45     EarlyStop             ``train.stop_at_val_loss``: ends the run at a good enough validation
46     StopOnRequest         a stop the driver asked for (signal, ``stop JOB``): ends the run after this step
50     CheckpointCallback    committed checkpoints every ``checkpoint.every_steps`` and at the end
55     CheckpointStats       bytes and seconds each rank hashed for checkpoints
190    StabilityReport       stability summary, timeline and plot at the end of the run
200    RunSummary            bad-record totals, unigram baseline, ``summary.json`` (MLflow and the run dir)
=====  ====================  ===========================================================================
"""

from __future__ import annotations

from typing import Any

import torch

from pretrain.checkpoint.store import HashTally
from pretrain.config import RunConfig, RunPlan
from pretrain.train.callbacks.checkpoint import CheckpointCallback
from pretrain.train.callbacks.checkpoint_stats import CheckpointStats
from pretrain.train.callbacks.early_stop import EarlyStop
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
from pretrain.train.callbacks.stability import StabilityCallback
from pretrain.train.callbacks.stability_report import StabilityReport
from pretrain.train.callbacks.stop import StopOnRequest
from pretrain.train.callbacks.system_metrics import SystemMetrics
from pretrain.train.callbacks.task_evaluation import PreparedTask, TaskEvaluation
from pretrain.train.callbacks.throughput import ThroughputMonitor
from pretrain.train.callbacks.validation import ValidationCallback
from pretrain.train.checkpointer import Checkpointer
from pretrain.train.stability_control import StabilityControl
from pretrain.train.trainer import Callback


def standard_callbacks(
    trainer_cfg: RunConfig,
    control: StabilityControl,
    checkpointer: Checkpointer,
    tracking_uri: str,
    plan: RunPlan,
    rank: int,
    *,
    run_id: str,
    tokenizer: Any,
    per_source: dict[str, list[dict[str, torch.Tensor]]],
    only_source: str,
    tasks: list[PreparedTask],
    hashed_at_setup: HashTally,
    byte_lengths: torch.Tensor | None = None,
) -> list[Callback]:
    """The callbacks of a training run: the standard ones, plus those of the enabled features. ``byte_lengths``
    (decoders): UTF-8 bytes of every token id, for ``val/bits_per_byte``; ``per_source``/``only_source``: the
    per-source validation sets (:class:`SourceValidation`); ``tasks``: the prepared ``eval.tasks``;
    ``hashed_at_setup``: the hash tally when the worker started (:class:`CheckpointStats`)."""
    features: list[Callback] = []
    if trainer_cfg.train.profile_at:
        features.append(ProfilerCallback(trainer_cfg.train.profile_at, trainer_cfg.train.profile_steps))
    if trainer_cfg.growth.schedule or trainer_cfg.growth.rewarm_steps > 0:  # also the re-warm after `grow`
        features.append(GrowthCallback(trainer_cfg))
    if trainer_cfg.layer_drop.enabled:
        features.append(LayerDropCallback(trainer_cfg, rank, plan.micro_batch_ids(rank)))
    if trainer_cfg.tracking.system_metrics:
        features.append(SystemMetrics())
    return features + [
        SpeedMonitor(),
        ThroughputMonitor(),
        MemoryMonitor(),
        StabilityCallback(control),
        StabilityReport(control, tracking_uri),
        HealthCallback(trainer_cfg.stability.health_every),
        FaultInjection(trainer_cfg),
        MetricsLogger(),
        ValidationCallback(byte_lengths),
        EarlyStop(trainer_cfg.train.stop_at_val_loss),
        StopOnRequest(),
        CheckpointCallback(checkpointer),
        SourceValidation(per_source, only_source, byte_lengths),
        TaskEvaluation(tasks, trainer_cfg.eval.every),
        CheckpointStats(hashed_at_setup),
        RunSummary(tokenizer, run_id),
    ]
