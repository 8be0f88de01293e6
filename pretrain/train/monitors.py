"""Speed and memory in the loop (every logged step, through ``extra_metrics``) and MLflow's own system metrics.

* :class:`ThroughputMonitor`: ``train/mfu`` — model FLOPs/s over the device peak, with the FLOP count and the
  peak of ``./launch.sh bench`` (:func:`pretrain.model.flops_per_token`, :func:`pretrain.model.peak.device_peak`:
  the measured matmul peak on CPU, the datasheet peak on known GPUs), over the step time of the logging interval
  (as ``train/tokens_per_s``); ``train/data_wait_frac`` — the share of (step + batch fetch) time spent waiting
  for the next batch (``trainer.shared.data_wait_s``).
* :class:`MemoryMonitor`: peak memory of every rank since the previous logged step — ``sys/max_allocated_gb``
  and ``sys/max_reserved_gb`` on CUDA (the allocator's peaks, reset each interval), ``sys/peak_rss_gb`` on CPU
  (the process's peak resident set, ``getrusage``: it cannot be reset, so it is the peak so far). The logged
  value is the largest over ranks; with several workers ``sys/rank<R>/...`` gives each rank's (one all-reduce).
* :class:`SystemMetrics`: ``tracking.system_metrics``: MLflow's ``SystemMetricsMonitor`` (CPU, memory, disk,
  network, GPU under ``system/``) on rank 0 for the run's duration.
"""

from __future__ import annotations

import resource
import time
from typing import Any

import torch

from pretrain.model import flops_per_token
from pretrain.model.peak import device_peak
from pretrain.train import dist
from pretrain.train.step import StepResult
from pretrain.train.trainer import Callback, Trainer

GB = float(1 << 30)
PEAK_SECONDS = 0.5
"""How long the matmul peak is measured at the start of a run (rank 0; CPUs and unknown GPUs)."""


class ThroughputMonitor(Callback):
    order = 2  # after the profiler (1): it times the steps, we only read clocks

    def __init__(self) -> None:
        self.peak = 0.0
        self.peak_source = ""
        self.flops_per_token = 0.0
        self.tokens_per_step = 0
        self.world = 1
        self._t0 = 0.0
        self._step_s = self._wait_s = 0.0
        self._steps = 0

    def _model_flops(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.flops_per_token = flops_per_token(cfg.model, cfg.model.max_seq_len, cfg.moe)

    def on_run_start(self, trainer: Trainer) -> None:
        self.tokens_per_step, self.world = trainer.plan.tokens_per_step, trainer.ctx.world_size
        self._model_flops(trainer)
        if trainer.ctx.is_main:  # only rank 0 logs
            dtype = torch.float32 if trainer.module.precision == "fp32" else torch.bfloat16
            self.peak, self.peak_source = device_peak(trainer.ctx.device, dtype, PEAK_SECONDS)
            trainer.progress.say(f"MFU peak: {self.peak / 1e12:.3f} TFLOP/s per worker ({self.peak_source}), "
                                 f"{self.flops_per_token:,.0f} model FLOPs/token")
            trainer.tracker.log_params({"mfu_peak_tflops_per_worker": f"{self.peak / 1e12:.4g}",
                                        "mfu_peak_source": self.peak_source})

    def on_model_changed(self, trainer: Trainer) -> None:
        self._model_flops(trainer)  # growth: more FLOPs per token from here on

    def on_step_start(self, trainer: Trainer, step: int) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._step_s += time.perf_counter() - self._t0
        self._wait_s += trainer.shared.data_wait_s
        self._steps += 1

    def extra_metrics(self) -> dict[str, float]:
        if not self._steps or not self.peak:
            return {}
        tokens_per_s = self._steps * self.tokens_per_step / max(self._step_s, 1e-9)
        out = {"train/mfu": self.flops_per_token * tokens_per_s / (self.peak * self.world),
               "train/data_wait_frac": self._wait_s / max(self._wait_s + self._step_s, 1e-9)}
        self._step_s = self._wait_s = 0.0
        self._steps = 0
        return out


def peak_rss_gb() -> float:
    """Peak resident set of this process so far, in GiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


class MemoryMonitor(Callback):
    """Collective in ``extra_metrics`` (every rank logs the same steps)."""

    order = 2  # reads the allocator's / the process's peaks; resets them per logging interval

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.rank, self.world = 0, 1

    def on_run_start(self, trainer: Trainer) -> None:
        self.device, self.rank, self.world = trainer.ctx.device, trainer.ctx.rank, trainer.ctx.world_size
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _local(self) -> dict[str, float]:
        if self.device.type == "cuda":
            out = {"max_allocated_gb": torch.cuda.max_memory_allocated(self.device) / GB,
                   "max_reserved_gb": torch.cuda.max_memory_reserved(self.device) / GB}
            torch.cuda.reset_peak_memory_stats(self.device)  # per logging interval
            return out
        return {"peak_rss_gb": peak_rss_gb()}

    def extra_metrics(self) -> dict[str, float]:
        local = self._local()
        keys = sorted(local)
        slots = [0.0] * (len(keys) * self.world)  # rank r's values in its own slots: one all-reduce
        for i, k in enumerate(keys):
            slots[i * self.world + self.rank] = local[k]
        slots = dist.all_reduce_sum(slots, self.device)
        out: dict[str, float] = {}
        for i, k in enumerate(keys):
            per_rank = slots[i * self.world:(i + 1) * self.world]
            out[f"sys/{k}"] = max(per_rank)
            if self.world > 1:
                out.update({f"sys/rank{r}/{k}": v for r, v in enumerate(per_rank)})
        return out


class SystemMetrics(Callback):
    """``tracking.system_metrics``: MLflow's own sampler (``system/*`` metrics) on rank 0 while the run trains."""

    order = 2  # a background sampler: starts before and stops after the steps, independent of their order

    def __init__(self) -> None:
        self.monitor: Any = None

    def on_run_start(self, trainer: Trainer) -> None:
        if not (trainer.ctx.is_main and trainer.tracker.enabled):
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.monitor = SystemMetricsMonitor(trainer.tracker.run_id, tracking_uri=trainer.tracker.uri,
                                            resume_logging=trainer.state.step > 0)
        self.monitor.start()

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None
