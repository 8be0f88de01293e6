"""The loop a user runs, timed in the same bench run as the step: ``python -m pretrain train`` as a subprocess
(the path ``./launch.sh train`` takes: run preparation, tokenizer, Ray, the engine, the data pipeline, every
callback, health probes, logging and MLflow), with its MLflow store and run directory in a temporary directory.

Its ``summary.json`` gives ``loop_tokens_per_s`` (steady state, see :mod:`pretrain.train.timing`) and the start-up
(``time_to_first_step_s``, per phase); :func:`loop_benchmark` puts them beside the step benchmark's tokens/s of the
same model, batch and threads (``loop_vs_step_ratio``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pretrain.checkpoint.layout import SUMMARY
from pretrain.timeline import PHASES

ROOT = Path(__file__).resolve().parents[1]


def loop_overrides(steps: int, threads: int, workers: int, micro_batch: int, global_batch: int) -> list[str]:
    """What the bench sets on the user's config: ``steps`` steps, the step bench's threads, and one micro-batch
    per worker per step (the step bench's unit; when the config's global batch differs, over one data stream per
    worker, else the config's streams). Validation and checkpoints keep their schedule: with ``steps`` below it,
    only the final ones run, after the timed steps."""
    batch = [] if global_batch == micro_batch * workers else [f"train.global_batch_size={micro_batch * workers}",
                                                              f"data.num_streams={workers}"]
    return [f"train.max_steps={steps}", f"train.num_threads={threads}", f"cluster.num_workers={workers}", *batch,
            "stability.plot_at_end=false"]


def run_training(config: str | None, overrides: list[str], timeout: float = 1800) -> dict:
    """``python -m pretrain train CONFIG OVERRIDES`` in a fresh temporary MLflow store and run directory (the
    working directory stays, so relative data paths and the tokenizer cache resolve as for the user); its summary."""
    with tempfile.TemporaryDirectory(prefix="pretrain-bench-loop-") as tmp:
        run_root = Path(tmp) / "runs"
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{Path(tmp) / 'mlflow.db'}",
               "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
        args = [sys.executable, "-m", "pretrain", "train", *([config] if config else []), *overrides,
                f"checkpoint.dir={run_root}"]
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
        summaries = sorted(run_root.glob(f"*/{SUMMARY}"))
        if proc.returncode != 0 or not summaries:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise RuntimeError(f"bench: the training run failed (exit {proc.returncode}):\n{tail}")
        summary = json.loads(summaries[0].read_text())
        profile = sorted((summaries[0].parent / "profile").glob("rank0_*.txt"))
        if profile:
            summary["profile_table"] = profile[0].read_text()
        return summary


def loop_benchmark(config: str | None, user_overrides: list[str], *, step_tokens_per_s: float, steps: int,
                   threads: int, micro_batch: int, global_batch: int, workers: int = 1) -> dict:
    """The real training loop of ``config`` beside the step benchmark's ``step_tokens_per_s`` (same model, batch
    and threads)."""
    summary = run_training(config, [*user_overrides, *loop_overrides(steps, threads, workers, micro_batch,
                                                                     global_batch)])
    rate = float(summary.get("loop_tokens_per_s", 0.0))
    return {"loop_tokens_per_s": rate, "loop_vs_step_ratio": rate / step_tokens_per_s if step_tokens_per_s else None,
            "loop_mean_tokens_per_s": float(summary.get("loop_mean_tokens_per_s", 0.0)),
            "loop_mean_vs_step_ratio": summary.get("loop_mean_tokens_per_s", 0.0) / step_tokens_per_s
            if step_tokens_per_s else None,
            "loop_steps_timed": summary.get("loop_steps_timed", 0), "loop_window": summary.get("loop_window", 0),
            "time_to_first_step_s": float(summary.get("time_to_first_step_s", 0.0)),
            "time_to_first_step_phases_s": dict(sorted(summary.get("startup_phases_s", {}).items(),
                                                       key=lambda kv: _phase_index(kv[0])))}


def _phase_index(phase: str) -> int:
    return PHASES.index(phase) if phase in PHASES else len(PHASES)
