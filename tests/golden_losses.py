"""Golden per-step losses: fixed runs through the real CLI (real Ray, real gloo, real MLflow) whose
per-step training loss, gradient norm and final validation loss must stay bitwise identical on CPU
across refactorings. ``tests/integration/train/test_golden.py`` reruns the cases and compares them with the files.

    python -m tests.golden_losses            # (re)record every case into tests/golden/*.json
    python -m tests.golden_losses CASE ...   # only these cases

Record only on purpose: a change of these numbers is a change of results.

Float sums are bitwise stable only for the same kernels and the same split of the work, so the cases pin both:
one intra-op thread per worker (``train.num_threads=1``) and the AVX2 code paths of ATen, MKL (its conditional
numerical reproducibility mode) and oneDNN (:data:`PINNED_ISA`), which every x86-64 CPU the suite runs on has.
Without the pins, goldens recorded on an AVX2 machine miss an AVX-512 one by about 1e-7.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from tests.harness import cli

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"
STEPS = 12
COMMON = [
    f"train.max_steps={STEPS}",
    "train.log_every=1",
    "train.val_every=6",
    "train.val_sequences=16",
    "checkpoint.every_steps=6",
    "data.tokenizer_train_docs=5000",
    "stability.plot_at_end=false",
    "train.num_threads=1",
]
# The CPU code paths the cases run on, whatever the machine's widest instruction set (see the module docstring).
PINNED_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

# name -> (preset, overrides). Each case exercises a different path of the step.
CASES: dict[str, tuple[str, list[str]]] = {
    "decoder-1w": ("demo-decoder", ["cluster.num_workers=1"]),
    "encoder-2w-zero3": ("demo-encoder", ["cluster.num_workers=2", "zero.stage=3", "train.micro_batch_size=4"]),
    "moe-2w-ep2": ("demo-moe", ["cluster.num_workers=2", "parallel.expert=2"]),
    "decoder-2w-zero2-dropout": (
        "demo-decoder",
        [
            "cluster.num_workers=2",
            "zero.stage=2",
            "train.micro_batch_size=4",
            "model.dropout=0.1",
            "stability.health_every=3",
        ],
    ),
}
METRICS = ("train/loss", "train/grad_norm", "val/loss")


def run_case(name: str, work: Path) -> dict:
    """Run one case in ``work`` (its own MLflow store); returns {metric: {step: float.hex}}."""
    preset, overrides = CASES[name]
    env = dict(
        os.environ,
        MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}",
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        **PINNED_ISA,
    )
    env.pop("RAY_ADDRESS", None)
    proc = cli(work, "train", str(ROOT / "configs" / f"{preset}.yaml"), *COMMON, *overrides, timeout=600, env=env)
    run_id = next(line.split()[-1] for line in proc.stdout.splitlines() if line.strip().startswith("MLflow run id"))
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    out = {}
    for metric in METRICS:
        history = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
        out[metric] = {str(m.step): float(m.value).hex() for m in history}
    return {"case": name, "preset": preset, "overrides": COMMON + overrides, "metrics": out}


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def main(argv: list[str]) -> int:
    names = argv or list(CASES)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
            result = run_case(name, Path(tmp))
        golden_path(name).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        losses = [float.fromhex(v) for v in result["metrics"]["train/loss"].values()]
        print(f"{name}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
