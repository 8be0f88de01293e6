"""What checkpoints cost a run, per rank, as a standard callback: the bytes and seconds each rank hashed for each
save and, on a resume, before its first step (the resumed checkpoint's verification: each file is hashed by one
rank, so the per-rank bytes add up to the checkpoint's bytes when a resume reads each byte once).

Summary keys (``summary.json``), read by ``./launch.sh bench --checkpoint``:

* ``checkpoint_hash_s_per_rank`` / ``checkpoint_hash_bytes_per_rank``: ``[rank][save]``, this run's saves in order;
* ``resume_hash_s_per_rank`` / ``resume_hash_bytes_per_rank``: ``[rank]``, hashed from worker setup to the loop
  (0 for a fresh run);
* ``checkpoint_bytes``: the last committed checkpoint's bytes (its manifest).

MLflow metrics (rank 0): ``ckpt/bytes`` per committed checkpoint, ``ckpt/hash_s_rank{r}`` per save,
``resume/hash_bytes`` and ``resume/hash_s_rank{r}``. The loop stall of each save is ``CheckpointCallback``'s
(``ckpt/stall_s``), the time to the first step ``SpeedMonitor``'s (``startup/time_to_first_step_s``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pretrain.checkpoint import layout, store
from pretrain.checkpoint.store import HashTally
from pretrain.train import dist
from pretrain.train.trainer import Callback, Trainer


class CheckpointStats(Callback):
    """Per-rank hashing of the run's saves and of its resume (see the module doc)."""

    order = 55  # after CheckpointCallback (50): a step's save, and a final save at the run's end, are done

    def __init__(self, at_setup: HashTally) -> None:
        """``at_setup``: :func:`store.hash_tally` when the worker began setting up (before the resume point)."""
        self.last = at_setup
        self.resume = HashTally()
        self.saves: list[tuple[int, HashTally]] = []

    def on_run_start(self, trainer: Trainer) -> None:
        now = store.hash_tally()
        self.resume, self.last = now - self.last, now

    def on_checkpoint(self, trainer: Trainer, path: Path) -> None:
        # Everything hashed since the previous commit belongs to this one (a background save hashes in its own
        # thread; the tally is process-wide).
        now = store.hash_tally()
        step = layout.step_of(Path(path).name)
        self.saves.append((trainer.state.step if step is None else step, now - self.last))
        self.last = now
        if trainer.ctx.is_main:
            trainer.tracker.log_metrics({"ckpt/bytes": float(store.read_manifest(Path(path)).total_bytes)},
                                        self.saves[-1][0])

    def on_run_end(self, trainer: Trainer, final: dict[str, Any]) -> None:
        parts = dist.gather_object({"resume": (self.resume.bytes, self.resume.seconds),
                                    "saves": [(s, t.bytes, t.seconds) for s, t in self.saves]})
        if not trainer.ctx.is_main:
            return
        final.update(summarize(parts))
        if trainer.last_checkpoint is not None:
            final["checkpoint_bytes"] = store.read_manifest(Path(trainer.last_checkpoint)).total_bytes
        for i, (step, _, _) in enumerate(parts[0]["saves"]):
            trainer.tracker.log_metrics({f"ckpt/hash_s_rank{r}": p["saves"][i][2] for r, p in enumerate(parts)
                                         if i < len(p["saves"])}, step)
        if final["resume_hash_bytes_per_rank"] and sum(final["resume_hash_bytes_per_rank"]):
            trainer.tracker.log_metrics({"resume/hash_bytes": float(sum(final["resume_hash_bytes_per_rank"])),
                                         **{f"resume/hash_s_rank{r}": s
                                            for r, s in enumerate(final["resume_hash_s_per_rank"])}},
                                        trainer.state.step)


def summarize(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary keys from every rank's ``{"resume": (bytes, s), "saves": [(step, bytes, s), ...]}``."""
    return {"checkpoint_hash_s_per_rank": [[s for _, _, s in p["saves"]] for p in parts],
            "checkpoint_hash_bytes_per_rank": [[b for _, b, _ in p["saves"]] for p in parts],
            "resume_hash_s_per_rank": [p["resume"][1] for p in parts],
            "resume_hash_bytes_per_rank": [p["resume"][0] for p in parts]}
