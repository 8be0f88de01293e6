"""Peak memory of every rank since the previous logged step (through ``extra_metrics``).

``sys/max_allocated_gb`` and ``sys/max_reserved_gb`` on CUDA (the allocator's peaks, reset each interval),
``sys/peak_rss_gb`` on CPU (the process's peak resident set, ``getrusage``: it cannot be reset, so it is the peak
so far). The logged value is the largest over ranks; with several workers ``sys/rank<R>/...`` gives each rank's
(one all-reduce).
"""

from __future__ import annotations

import resource

import torch

from pretrain.train import dist
from pretrain.train.callbacks.base import Callback
from pretrain.train.trainer import Trainer

GB = float(1 << 30)


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
            out = {
                "max_allocated_gb": torch.cuda.max_memory_allocated(self.device) / GB,
                "max_reserved_gb": torch.cuda.max_memory_reserved(self.device) / GB,
            }
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
            per_rank = slots[i * self.world : (i + 1) * self.world]
            out[f"sys/{k}"] = max(per_rank)
            if self.world > 1:
                out.update({f"sys/rank{r}/{k}": v for r, v in enumerate(per_rank)})
        return out
