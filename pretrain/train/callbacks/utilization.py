"""``train/mfu`` and ``train/data_wait_frac`` at every logged step (through ``extra_metrics``).

``train/mfu``: model FLOPs/s over the device peak, with the FLOP count and the peak of ``./launch.sh bench``
(:func:`pretrain.model.flops_per_token`, :func:`pretrain.model.peak.device_peak`: the measured matmul peak on CPU,
the datasheet peak on known GPUs), over the step time of the logging interval (as ``train/tokens_per_s``: a
growth's rebuild is not step time; each step counts the FLOPs of the model it trained).
``train/data_wait_frac``: the share of (step + batch fetch) time spent waiting for the next batch
(``trainer.shared.data_wait_s``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pretrain.model import flops_per_token
from pretrain.model.peak import device_peak
from pretrain.train.callbacks.base import Callback
from pretrain.train.step import StepResult
from pretrain.train.trainer import Trainer
from pretrain.user_cache import cache_root

PEAK_SECONDS = 0.5


def peak_warning(mfu: float, peak: float, source: str) -> str:
    """The line a run prints once when its MFU exceeds 1: its peak cannot be the device's (a measured one kept in the
    user's cache from a busy machine, most likely)."""
    where = (
        f"a measured peak is kept in {cache_root() / 'matmul-peak'}/ and was likely measured while the machine was "
        "busy: delete it to measure again"
        if source == "measured"
        else "the datasheet figure is below what this device reaches"
    )
    return f"warning: MFU {mfu:.0%} is above 100 %: the peak of {peak / 1e12:.3f} TFLOP/s is too low ({where})"


class ThroughputMonitor(Callback):
    order = 2  # after the profiler (1): it times the steps, we only read clocks

    def __init__(self) -> None:
        self.peak = 0.0
        self.peak_source = ""
        self.flops_per_token = 0.0
        self.tokens_per_step = 0
        self.world = 1
        self._step_s = self._wait_s = self._flops = 0.0
        self._steps = 0
        self._say: Callable[[str], None] = print
        self._warned = False

    def _model_flops(self, trainer: Trainer) -> None:
        cfg = trainer.cfg
        self.flops_per_token = flops_per_token(cfg.model, cfg.model.max_seq_len, cfg.moe)

    def on_run_start(self, trainer: Trainer) -> None:
        self.tokens_per_step, self.world = trainer.plan.tokens_per_step, trainer.ctx.world_size
        self._model_flops(trainer)
        if trainer.ctx.is_main:  # only rank 0 logs
            self._say = trainer.progress.say
            dtype = torch.float32 if trainer.module.precision == "fp32" else torch.bfloat16
            self.peak, self.peak_source = device_peak(trainer.ctx.device, dtype, PEAK_SECONDS)
            trainer.progress.say(
                f"MFU peak: {self.peak / 1e12:.3f} TFLOP/s per worker ({self.peak_source}), "
                f"{self.flops_per_token:,.0f} model FLOPs/token"
            )
            trainer.tracker.log_params(
                {"mfu_peak_tflops_per_worker": f"{self.peak / 1e12:.4g}", "mfu_peak_source": self.peak_source}
            )

    def on_model_changed(self, trainer: Trainer) -> None:
        self._model_flops(trainer)  # growth: more FLOPs per token from here on (the rebuild is not step time)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        # the speed monitor's step time, which tokens/s is measured over too (not this callback's stamps, which
        # the first step's start-up report and the profiler's trace, between the two, would land inside)
        self._step_s += trainer.shared.step_s
        self._wait_s += trainer.shared.data_wait_s
        self._flops += self.flops_per_token * self.tokens_per_step  # at the size this step trained
        self._steps += 1

    def extra_metrics(self) -> dict[str, float]:
        if not self._steps or not self.peak:
            return {}
        out = {
            "train/mfu": self._flops / max(self._step_s, 1e-9) / (self.peak * self.world),
            "train/data_wait_frac": self._wait_s / max(self._wait_s + self._step_s, 1e-9),
        }
        self._step_s = self._wait_s = self._flops = 0.0
        self._steps = 0
        if out["train/mfu"] > 1 and not self._warned:
            self._warned = True
            self._say(peak_warning(out["train/mfu"], self.peak, self.peak_source))
        return out
