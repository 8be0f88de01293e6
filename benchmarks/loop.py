"""The loop a user runs, timed in the same bench run as the step: ``python -m pretrain train`` as a subprocess
(the path ``./launch.sh train`` takes: run preparation, tokenizer, Ray for more than one worker, the engine, the
data pipeline, every callback, health probes, logging and MLflow), with its MLflow store and run directory in a
temporary directory.

Its ``summary.json`` gives ``loop_tokens_per_s`` (steady state, see :mod:`pretrain.train.callbacks.speed`) and the
start-up (``time_to_first_step_s``, per phase); :func:`loop_benchmark` puts them beside the step benchmark's tokens/s of
the same model, batch and threads (``loop_vs_step_ratio``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pretrain.checkpoint.layout import SUMMARY
from pretrain.timeline import PHASES

ROOT = Path(__file__).resolve().parents[1]


def loop_overrides(steps: int, threads: int, workers: int, micro_batch: int, global_batch: int) -> list[str]:
    """What the bench sets on the user's config: ``steps`` steps, the step bench's threads, and one micro-batch
    per worker per step (the step bench's unit; when the config's global batch differs, over one data stream per
    worker, else the config's streams). Validation and checkpoints keep their schedule: with ``steps`` below it,
    only the final ones run, after the timed steps."""
    batch = (
        []
        if global_batch == micro_batch * workers
        else [f"train.global_batch_size={micro_batch * workers}", f"data.num_streams={workers}"]
    )
    return [
        f"train.max_steps={steps}",
        f"train.num_threads={threads}",
        f"cluster.num_workers={workers}",
        *batch,
        "stability.plot_at_end=false",
    ]


RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def run_training(
    config: str | None, overrides: list[str], timeout: float = 1800, command: list[str] | None = None
) -> dict:
    """``python -m pretrain train CONFIG OVERRIDES`` (or ``command``, e.g. ``[launch.sh, train]``) in a fresh
    temporary MLflow store and run directory (the working directory stays, so relative data paths and the tokenizer
    cache resolve as for the user); its summary, plus the command's wall time (``command_wall_s``)."""
    with tempfile.TemporaryDirectory(prefix="pretrain-bench-loop-") as tmp:
        run_root = Path(tmp) / "runs"
        # Not this process's rendezvous (dist.setup exports it for the step benchmark): the training command makes
        # its own, so it never listens on a port that was free when this process picked it.
        env = {
            **{k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV},
            "MLFLOW_TRACKING_URI": f"sqlite:///{Path(tmp) / 'mlflow.db'}",
            "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
        }
        args = [
            *(command or [sys.executable, "-m", "pretrain", "train"]),
            *([config] if config else []),
            *overrides,
            f"checkpoint.dir={run_root}",
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        summaries = sorted(run_root.glob(f"*/{SUMMARY}"))
        if proc.returncode != 0 or not summaries:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"bench: the training run failed (exit {proc.returncode}):\n{tail}")
        summary = json.loads(summaries[0].read_text())
        summary["command_wall_s"] = wall
        profile = sorted((summaries[0].parent / "profile").glob("rank0_*.txt"))
        if profile:
            summary["profile_table"] = profile[0].read_text()
        return summary


def loop_benchmark(
    config: str | None,
    user_overrides: list[str],
    *,
    step_tokens_per_s: float,
    steps: int,
    threads: int,
    micro_batch: int,
    global_batch: int,
    workers: int = 1,
) -> dict:
    """The real training loop of ``config`` beside the step benchmark's ``step_tokens_per_s`` (same model, batch
    and threads). With ``workers`` > 1 the threads are divided among them (each worker's micro-batch stays the
    step benchmark's, so the global batch grows), ``loop_vs_step_ratio`` becomes the scaling over the one-process
    step, and ``loop_vs_own_step_ratio`` (the loop's wall-clock tokens/s over the time inside its own steps, any
    worker count) is the loop's cost beyond its step."""
    per_worker = max(1, threads // workers)
    summary = run_training(
        config, [*user_overrides, *loop_overrides(steps, per_worker, workers, micro_batch, global_batch)]
    )
    rate = float(summary.get("loop_tokens_per_s", 0.0))
    own = float(summary.get("tokens_per_s", 0.0))
    return {
        "loop_workers": workers,
        "loop_threads_per_worker": summary.get("torch_threads", per_worker),
        "loop_tokens_per_s": rate,
        "loop_vs_step_ratio": rate / step_tokens_per_s if step_tokens_per_s else None,
        "loop_mean_tokens_per_s": float(summary.get("loop_mean_tokens_per_s", 0.0)),
        "loop_mean_vs_step_ratio": summary.get("loop_mean_tokens_per_s", 0.0) / step_tokens_per_s
        if step_tokens_per_s
        else None,
        "loop_step_tokens_per_s": own,
        "loop_vs_own_step_ratio": rate / own if own else None,
        "loop_steps_timed": summary.get("loop_steps_timed", 0),
        "loop_window": summary.get("loop_window", 0),
        "loop_command_wall_s": summary.get("command_wall_s"),
        "time_to_first_step_s": float(summary.get("time_to_first_step_s", 0.0)),
        "time_to_first_step_phases_s": dict(
            sorted(summary.get("startup_phases_s", {}).items(), key=lambda kv: _phase_index(kv[0]))
        ),
    }


def _phase_index(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else len(PHASES)
