"""Progress line printed by rank 0 (Ray forwards it to the driver's console line by line)."""

from __future__ import annotations

import sys
import time


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Tracks step time (excluding validation and checkpointing) to report tokens/s and an ETA."""

    def __init__(self, max_steps: int, start_step: int, tokens_per_step: int, enabled: bool):
        self.max_steps, self.start_step = max_steps, start_step
        self.tokens_per_step = tokens_per_step
        self.enabled = enabled
        self.train_seconds = 0.0
        self.steps_timed = 0
        self._window_seconds = 0.0
        self._window_steps = 0
        self.t0 = time.perf_counter()

    def add_step(self, seconds: float) -> None:
        self.train_seconds += seconds
        self.steps_timed += 1
        self._window_seconds += seconds
        self._window_steps += 1

    def window_tokens_per_s(self) -> float:
        """Tokens/s over the steps since the last call (then resets the window)."""
        rate = self._window_steps * self.tokens_per_step / max(self._window_seconds, 1e-9)
        self._window_seconds, self._window_steps = 0.0, 0
        return rate

    def tokens_per_s(self) -> float:
        return self.steps_timed * self.tokens_per_step / max(self.train_seconds, 1e-9)

    def line(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        done = self.steps_timed  # steps this process ran (a rollback past the resume step makes step - start < 0)
        eta = elapsed / max(done, 1) * max(self.max_steps - step, 0)
        width = len(str(self.max_steps))
        parts = [
            f"step {step:>{width}}/{self.max_steps}",
            f"loss {metrics['train/loss']:.4f}",
            f"lr {metrics['train/lr']:.2e}",
            f"gnorm {metrics['train/grad_norm']:.3f}",
            f"{metrics['train/tokens_per_s']:,.0f} tok/s",
            *_optional(metrics),
            f"elapsed {fmt_duration(elapsed)}",
            *([f"layers {metrics['train/active_layers']:.2f}"] if "train/active_layers" in metrics else []),
            f"ETA {fmt_duration(eta)}",
        ]
        print("[train] " + " | ".join(parts), file=sys.stdout, flush=True)

    def say(self, text: str) -> None:
        if self.enabled:
            print(f"[train] {text}", file=sys.stdout, flush=True)


_OPTIONAL = (
    ("train/mfu", "MFU {:.1%}"),
    ("train/data_wait_frac", "data wait {:.0%}"),
    ("sys/max_allocated_gb", "mem {:.2f} GB"),
    ("sys/peak_rss_gb", "rss {:.2f} GB"),
)
"""Progress-line parts of metrics that only some runs log (the monitors' ``extra_metrics``)."""


def _optional(metrics: dict[str, float]) -> list[str]:
    return [fmt.format(metrics[key]) for key, fmt in _OPTIONAL if key in metrics]
