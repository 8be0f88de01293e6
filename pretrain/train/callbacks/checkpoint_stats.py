"""What checkpoints cost a run, per rank, as a standard callback: the bytes and seconds each rank hashed for the
run's saves and, on a resume, before its first step (the resumed checkpoint's verification: each file is hashed by
one rank, so the per-rank bytes add up to the checkpoint's bytes when a resume reads each byte once).

Hashing is counted by the process-wide :func:`hash_tally`, whichever thread hashes (an asynchronous save
hashes in the background, finishing at a later step): what a rank hashed between the start of the loop and its end
(every save waited for) is its saves'; a save's share is that over the number of saves.

Summary keys (``summary.json``), read by ``./launch.sh bench --checkpoint``:

* ``checkpoint_hash_s_per_rank`` / ``checkpoint_hash_bytes_per_rank``: ``[rank]``, per save (the run's mean);
* ``resume_hash_s_per_rank`` / ``resume_hash_bytes_per_rank``: ``[rank]``, hashed from worker setup to the loop
  (0 for a fresh run);
* ``checkpoint_bytes``: the last committed checkpoint's bytes (its manifest).

MLflow metrics (rank 0, at the last step): ``ckpt/bytes``, ``ckpt/hash_s_rank{r}`` (per save),
``resume/hash_bytes`` and ``resume/hash_s_rank{r}``. The loop stall of each save is the checkpointer's
(``ckpt/stall_s``), the time to the first step ``SpeedMonitor``'s (``startup/time_to_first_step_s``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.checkpoint import store
from pretrain.checkpoint.hash_tally import HashTally, hash_tally
from pretrain.train import dist
from pretrain.train.callbacks.base import Callback
from pretrain.train.trainer import Trainer


class CheckpointStats(Callback):
    """Per-rank hashing of the run's saves and of its resume (see the module doc)."""

    order = 55  # after CheckpointCallback (50), whose run end commits the last save

    def __init__(self, at_setup: HashTally) -> None:
        """``at_setup``: :func:`hash_tally` when the worker began setting up (before the resume point)."""
        self.at_setup = self.at_start = at_setup
        self.saves = 0

    def on_run_start(self, trainer: Trainer) -> None:
        self.at_start = hash_tally()

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        self.saves += 1

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        now = hash_tally()
        resume, saves = self.at_start - self.at_setup, now - self.at_start
        parts = dist.gather_object(
            {"resume": (resume.bytes, resume.seconds), "saves": (saves.bytes, saves.seconds), "count": self.saves}
        )
        if not trainer.ctx.is_main:
            return
        final.update(summarize(parts))
        step, metrics = trainer.state.step, {}
        if trainer.last_checkpoint is not None:
            final["checkpoint_bytes"] = store.read_manifest(Path(trainer.last_checkpoint)).total_bytes
            metrics["ckpt/bytes"] = float(final["checkpoint_bytes"])
        if self.saves:
            metrics.update({f"ckpt/hash_s_rank{r}": s for r, s in enumerate(final["checkpoint_hash_s_per_rank"])})
        if sum(final["resume_hash_bytes_per_rank"]):
            metrics["resume/hash_bytes"] = float(sum(final["resume_hash_bytes_per_rank"]))
            metrics.update({f"resume/hash_s_rank{r}": s for r, s in enumerate(final["resume_hash_s_per_rank"])})
        trainer.tracker.log_metrics(metrics, step)


def summarize(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary keys from every rank's ``{"resume": (bytes, s), "saves": (bytes, s), "count": saves}``."""
    per = [max(p["count"], 1) for p in parts]
    return {
        "checkpoint_hash_s_per_rank": [p["saves"][1] / n for p, n in zip(parts, per)],
        "checkpoint_hash_bytes_per_rank": [p["saves"][0] / n for p, n in zip(parts, per)],
        "resume_hash_s_per_rank": [p["resume"][1] for p in parts],
        "resume_hash_bytes_per_rank": [p["resume"][0] for p in parts],
    }
