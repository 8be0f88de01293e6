"""The training side of checkpointing: the :class:`Checkpointer` that ``CheckpointCallback`` calls. It checks the
weights, then hands the run's state to the checkpoint layer's collective writer (``pretrain/checkpoint/writer.py``)
with the engine's own save as the model state; registration in MLflow is the writer's hook."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pretrain.checkpoint.store import CheckpointError
from pretrain.checkpoint.writer import CheckpointWriter, Contents, EngineState
from pretrain.config import RunConfig
from pretrain.train import dist
from pretrain.train.health import nonfinite_params


class NonFiniteWeightsError(CheckpointError):
    """The weights hold NaN/Inf: the checkpoint was not written."""


class DistWorld:
    """The training job's process group as the writer's :class:`~pretrain.checkpoint.writer.World`."""

    def __init__(self, ctx: dist.DistContext):
        self.rank, self.world_size = ctx.rank, ctx.world_size

    def barrier(self) -> None:
        dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        return dist.broadcast_object(obj)

    def gather(self, obj: Any) -> list[Any]:
        return dist.gather_object(obj)


class Checkpointer:
    """Writes committed checkpoints of this run (collective: every rank calls ``save``)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, ctx: dist.DistContext, tracker):
        self.ctx = ctx
        self.writer = CheckpointWriter(run_dir, DistWorld(ctx), tracker.run_id, keep_last=cfg.checkpoint.keep_last,
                                       register=tracker.register_checkpoint)
        self.seconds = 0.0  # wall time spent in save (write + verify + commit)
        self.count = 0

    def save(self, module, batches, state, protect: set[str] = frozenset()) -> Path | None:
        """``protect``: checkpoint paths pruning must keep (every callback's ``protected_paths``)."""
        t0 = time.perf_counter()
        try:
            # Every rank checks its shard before anything is staged: a NaN/Inf checkpoint is never written.
            if dist.all_reduce_sum([nonfinite_params(module.engine)], self.ctx.device)[0] > 0:
                raise NonFiniteWeightsError(f"step {state.step}: non-finite weights, checkpoint not written")
            # The module's config: the architecture as of this step (growth).
            contents = Contents(cfg=module.cfg, trainer_state=asdict(state), data_state=batches.state_dict(),
                                model=EngineState(module.save))
            return self.writer.save(contents, protect)
        finally:  # the loop stalls for the whole write + commit: measured for `bench --cluster`
            self.seconds += time.perf_counter() - t0
            self.count += 1
