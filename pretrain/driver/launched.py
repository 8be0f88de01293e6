"""One run per launch: the CLI under ``torchrun`` (or any launcher that starts it once per rank with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as Slurm + torchrun does).

Every rank runs ``python -m pretrain train ...``; left alone, each would create a run of its own (an MLflow run, a
tokenizer, a checkpoint directory) and the ranks would write one checkpoint into different directories. Here rank
0 alone prepares the job and tracks the run; it hands the prepared job to the other ranks through the launcher's
key-value store (the c10d store ``env://`` names: torchrun's agent store, or one that rank 0 hosts), and they
train it as followers: no run of their own, no summary, their output in ``RUN_DIR/logs/rank_N.log``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

# How long a follower waits for rank 0's job: the preparation may train a tokenizer over a large corpus. When rank 0
# fails instead, the launcher ends the followers (torchrun stops the whole group).
JOB_WAIT = timedelta(hours=24)
RUN_KEY = "pretrain/run"
"""The launch store's key of the run the launch trains (:meth:`Launch.note_run`)."""


@dataclass
class Launch:
    """This process's place in a multi-process launch."""

    rank: int
    world_size: int
    _store: Any = field(default=None, repr=False, compare=False)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def _key(self) -> str:
        # A restarted launch (torchrun --max-restarts) prepares anew: one key per attempt.
        return f"pretrain/job/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def store(self):
        """The launch's key-value store, opened once: where rank 0 hosts it (no torchrun agent), it lives as long
        as this object, so the job stays readable while the followers start."""
        if self._store is None:
            import torch.distributed as dist

            self._store, _, _ = next(dist.rendezvous("env://", rank=self.rank, world_size=self.world_size))
            self._store.set_timeout(JOB_WAIT)
        return self._store

    def publish(self, job: Any) -> None:
        """Rank 0: hand the prepared ``job`` to the other ranks."""
        self.store().set(self._key(), json.dumps(asdict(job)))

    def receive(self) -> dict[str, Any]:
        """Any other rank: rank 0's job (as a dict), once it is prepared."""
        return json.loads(self.store().get(self._key()))

    def note_run(self, job: Any) -> None:
        """Rank 0: the run this launch trains, kept in the launch's store, which every attempt of a ``torchrun``
        launch shares (``--max-restarts``: after a rank fails, the agent starts every rank again with the same
        command) and no other launch sees."""
        self.store().set(RUN_KEY, json.dumps({"run_id": job.run_id, "run_dir": job.run_dir}))

    def earlier_run(self, env: Mapping[str, str] = os.environ) -> str | None:
        """Rank 0 of a restarted torchrun attempt: the run an earlier attempt of this launch trained, when it has a
        committed checkpoint to resume from; else None (a first attempt, or nothing to resume: a new run)."""
        from pretrain.checkpoint import latest_committed

        if env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" or not self.store().check([RUN_KEY]):
            return None
        noted = json.loads(self.store().get(RUN_KEY))
        return noted["run_id"] if latest_committed(Path(noted["run_dir"])) is not None else None


def launched(env: Mapping[str, str] = os.environ) -> Launch | None:
    """The launch this process is one rank of, per ``env`` (this process's environment), or None: a plain process,
    or one of Ray Train's workers (whose world Ray sets up after the command's preparation)."""
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
    except ValueError:
        return None
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    if world <= 1 and not env.get("TORCHELASTIC_RUN_ID"):  # one process under torchrun: its restarts resume too
        return None
    return Launch(rank, world)


def follow(launch: Launch) -> int:
    """A rank other than 0: train rank 0's job, output in ``RUN_DIR/logs/rank_N.log``; exit status 0. A stop
    (SIGTERM, SIGINT) is rank 0's: torchrun's agent forwards the one it gets to every rank, and a follower ended by
    it inside a step would leave rank 0 in a collective with no checkpoint; so under torchrun (its
    ``TORCHELASTIC_RUN_ID`` set) a training follower ignores it and stops after the same step as rank 0, which tells
    every rank at the step boundary; the agent SIGKILLs the ranks 30 s after it forwarded the signal. Under another
    launcher, which may send no SIGKILL, a follower keeps the default handlers."""
    import signal

    from cluster.launch import train_worker
    from pretrain.driver.console import QuietConsole

    job = launch.receive()
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    with QuietConsole(Path(job["run_dir"]) / "logs" / f"rank_{launch.rank}.log"):
        train_worker(job)
    return 0
