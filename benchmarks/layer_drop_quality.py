"""Layer-dropout quality on the demo corpus (dated results: ``benchmarks/results/``): an 8-layer demo decoder
trained for the same steps without and with layer dropout; validation loss of the full model and of its
``every_other`` pruned 4-layer model.

    python -m benchmarks.layer_drop_quality [--steps 200] [--rate 0.5] [key=value ...]

Runs the real CLI (``train``, ``prune``, ``eval``) in a scratch directory with its own MLflow store and prints one
table row per variant; the numbers are whatever they are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(work: Path, *args: str) -> str:
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def _eval_loss(work: Path, target: str) -> float:
    return float(json.loads(_cli(work, "eval", target, "--json"))["loss"])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer_drop_quality")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    base = [
        str(ROOT / "configs" / "demo-decoder.yaml"),
        "model.num_layers=8",
        f"train.max_steps={a.steps}",
        "checkpoint.every_steps=0",
        "stability.plot_at_end=false",
        *a.overrides,
    ]
    variants = {"no layer dropout": [], f"layer dropout {a.rate:g} (layer mode)": [f"layer_drop.rate={a.rate}"]}
    rows = []
    with tempfile.TemporaryDirectory(prefix="ld-quality-") as tmp:
        work = Path(tmp)
        for name, extra in variants.items():
            out = _cli(work, "train", *base, *extra)
            run_id = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("MLflow run id"))
            tps = next((line.split()[-2] for line in out.splitlines() if "tokens/s" in line and "train" in line), "?")
            full = _eval_loss(work, run_id)
            pruned_out = _cli(work, "prune", run_id, "layers=every_other")
            child = next(
                line.split()[3].rstrip(":") for line in pruned_out.splitlines() if line.startswith("[prune] new run")
            )
            rows.append((name, full, _eval_loss(work, child), tps))
            print(f"{name}: full {full:.4f}, every_other pruned {rows[-1][2]:.4f}", flush=True)
    print(f"\n| 8-layer demo decoder, {a.steps} steps | val loss, 8 layers | val loss, every_other (4 layers) |")
    print("| --- | --- | --- |")
    for name, full, pruned, _ in rows:
        print(f"| {name} | {full:.3f} | {pruned:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
