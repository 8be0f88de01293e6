"""Cluster-job latency, measured end to end as a user sees it (``./launch.sh bench --cluster``):

- ``submit_to_first_step_s``: from running ``submit`` to the first ``[train] step`` line in the job log
  (validation, packaging the working dir, job driver start, Ray Train worker group, DeepSpeed init);
- ``checkpoint_time_frac``: share of the training loop's time spent writing and committing
  checkpoints (from the run summary), with ``checkpoint.every_steps`` as given.

Uses the local head of ``./launch.sh cluster up`` (started and stopped here when none is running).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pretrain.config.errors import ArgumentParser

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.max_seq_len=64",
    "data.tokenizer_vocab_size=1024",
    "data.tokenizer_train_docs=3000",
    "data.num_streams=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.log_every=1",
    "train.val_sequences=8",
    "cluster.num_workers=1",
]


def _pretrain(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pretrain", *args], cwd=Path.cwd(), text=True, capture_output=True, **kw
    )


def measure(steps: int, every: int) -> dict:
    st = _pretrain("cluster", "status")
    head_was_up = st.returncode == 0 and "state:     alive" in st.stdout
    if not head_was_up:
        up = _pretrain("cluster", "up")
        if up.returncode:
            raise RuntimeError(f"cluster up failed: {up.stderr.strip() or up.stdout.strip()}")
    try:
        t0 = time.perf_counter()
        sub = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pretrain",
                "submit",
                str(ROOT / "configs" / "demo-decoder.yaml"),
                *TINY,
                f"train.max_steps={steps}",
                f"checkpoint.every_steps={every}",
                f"train.val_every={steps}",
            ],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        job_id = run_id = ""
        assert sub.stdout is not None  # stdout=PIPE
        for line in sub.stdout:
            if line.startswith("job id:"):
                job_id = line.split(":", 1)[1].strip()
            if line.startswith("MLflow run id:"):
                run_id = line.split(":", 1)[1].strip()
        sub.wait()
        if not job_id:
            raise RuntimeError("submit printed no job id")
        logs = subprocess.Popen(
            [sys.executable, "-m", "pretrain", "logs", job_id, "--follow"],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        first_step = None
        assert logs.stdout is not None  # stdout=PIPE
        for line in logs.stdout:
            if first_step is None and "[train] step " in line and "/" in line.split("[train] step ", 1)[1][:12]:
                first_step = time.perf_counter() - t0
        logs.wait()
        status = _pretrain("status", job_id).stdout.strip()
    finally:
        if not head_was_up:
            _pretrain("cluster", "down")
    summary = {}
    from pretrain.checkpoint.layout import SUMMARY

    for path in (Path.cwd() / "checkpoints").glob(f"{run_id}/{SUMMARY}"):
        summary = json.loads(path.read_text())
    train_s, ckpt_s = summary.get("train_seconds"), summary.get("checkpoint_seconds")
    return {
        "job_status": status,
        "run_id": run_id,
        "submit_to_first_step_s": first_step,
        "steps": steps,
        "checkpoint_every_steps": every,
        "checkpoints": summary.get("checkpoints"),
        "checkpoint_seconds": ckpt_s,
        "train_seconds": train_s,
        "checkpoint_time_frac": ckpt_s / (ckpt_s + train_s) if train_s and ckpt_s is not None else None,
    }


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh bench --cluster")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="checkpoint.every_steps")
    p.add_argument("--json", action="store_true")
    a = p.parse_args([x for x in argv if x != "--cluster"])
    result = measure(a.steps, a.every)
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k:<26} {v:.3f}" if isinstance(v, float) else f"{k:<26} {v}")
    return 0 if result["job_status"] == "SUCCEEDED" else 1
