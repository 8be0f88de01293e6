"""Golden per-step losses: fixed runs through the real CLI (real gloo, real MLflow) whose
per-step training loss, gradient norm and final validation loss must stay bitwise identical on CPU
across refactorings. ``tests/integration/train/test_golden.py`` reruns the cases and compares them with the files.
One case of 2 workers runs through Ray Train (:data:`THROUGH_RAY`); the others of several workers run as
``torchrun`` ranks (``cluster.use_ray=false``, the launch the README shows without Ray): the numbers are the
training's, and both launches give them bitwise alike.

    python -m tests.golden_losses            # (re)record every case into tests/golden/*.json
    python -m tests.golden_losses CASE ...   # only these cases
    python -m tests.golden_losses --this-machine CASE ...   # add this machine's recording beside the file's

Record only on purpose: a change of these numbers is a change of results.

Float sums are bitwise stable only for the same kernels and the same split of the work, so the cases pin both:
one intra-op thread per worker (``train.num_threads=1``) and the code paths of ATen (AVX2), oneDNN (AVX2) and MKL
(:data:`PINNED_ISA`). Without the pins, goldens recorded on an AVX2 machine miss an AVX-512 one by about 1e-7.
MKL's reproducibility mode is ``COMPATIBLE`` (SSE2): its other branches (``AVX2`` ...) exist only on Intel
processors, and elsewhere MKL silently takes its automatic branch, so an AMD CPU missed AVX2-pinned goldens recorded
on an Intel one by up to 6e-6. ``COMPATIBLE`` is MKL's one branch for Intel and non-Intel processors alike.

Each golden file also holds :func:`kernel_fingerprint`, a hash of fixed operations run under the pins. A machine
whose pinned kernels still round differently (another fingerprint) cannot reproduce the files bitwise; the test
then compares within :data:`OTHER_KERNELS_RTOL` and says so, instead of failing on rounding.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.harness import cli

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"
STEPS = 12
COMMON = [
    # the presets' blocks, narrower and on shorter sequences: the cases pin the step's code paths, not a size
    "model.hidden_size=128",
    "model.max_seq_len=64",
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
PINNED_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# Where the fingerprint differs: the largest relative difference allowed (rounding grows to about 1e-5 in 12 steps;
# a changed result, such as another data order or learning rate, moves the losses by far more).
OTHER_KERNELS_RTOL = 1e-4
_FINGERPRINT = """
import hashlib, torch, torch.nn.functional as F
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x = torch.randn(96, 200, generator=g, requires_grad=True)
w = torch.randn(136, 200, generator=g, requires_grad=True)
y = F.linear(x, w)
h = F.gelu(F.layer_norm(y, (136,)))
z = F.softmax(h @ h.T / 8, dim=-1) @ h
loss = F.cross_entropy(z, torch.arange(96) % 136) + z.exp().mean().log1p()
loss.backward()
parts = (y, h, z, loss, x.grad, w.grad, torch.randn(512, 512, generator=g) @ torch.randn(512, 384, generator=g))
print(hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in parts)).hexdigest()[:16])
"""

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
THROUGH_RAY = ("decoder-2w-zero2-dropout",)
"""The cases run through Ray Train on an embedded Ray (the README's ``zero.stage=2 cluster.num_workers=2``); the
other cases of several workers run as ``torchrun`` ranks."""


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
    kernels = kernel_fingerprint()
    workers = next((int(o.split("=")[1]) for o in overrides if o.startswith("cluster.num_workers=")), 1)
    if workers == 1 or name in THROUGH_RAY:
        launch, workers = [], 1  # one process: in the command's own, or Ray starts the workers
    else:
        launch = ["cluster.use_ray=false"]  # how it runs, not part of the case: torchrun's ranks
    preset_yaml = str(ROOT / "configs" / f"{preset}.yaml")
    proc = cli(work, "train", preset_yaml, *COMMON, *overrides, *launch, timeout=600, env=env, ranks=workers)
    run_id = next(line.split()[-1] for line in proc.stdout.splitlines() if line.strip().startswith("MLflow run id"))
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    out = {}
    for metric in METRICS:
        history = sorted(client.get_metric_history(run_id, metric), key=lambda m: (m.step, m.timestamp))
        out[metric] = {str(m.step): float(m.value).hex() for m in history}
    return {
        "case": name,
        "preset": preset,
        "overrides": COMMON + overrides,
        "metrics": out,
        "kernels": kernels,
        "machine": machine_id(),
    }


def machine_id() -> str:
    """A hash of this machine's processor (model name and instruction-set flags) and torch's version. Two machines
    with one kernel fingerprint have still been seen to differ by an ulp in losses of two workers and by 7e-7 in
    gradient norms (an AVX2 recording replayed on an AVX-512 FP16 processor): a file recorded on another machine is
    compared bitwise only when it names none (the files recorded before this field)."""
    import platform

    import torch

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join([*lines, torch.__version__]).encode()).hexdigest()[:16]


@functools.cache  # one per process: the pins and the machine do not change
def kernel_fingerprint() -> str:
    """A hash of fixed matrix products, norms, activations and their gradients, computed in a fresh process under
    :data:`PINNED_ISA` and one thread: equal on two machines when their pinned kernels round alike."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run(
        [sys.executable, "-c", _FINGERPRINT], env={**env, **PINNED_ISA}, capture_output=True, text=True, check=True
    )
    return proc.stdout.strip()


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def recording_for(want: dict, got: dict) -> tuple[dict, bool]:
    """The metrics of golden file ``want`` to compare run ``got`` with, and whether bitwise: this machine's own
    recording (``other_machines``, added by ``--this-machine``), else the file's, bitwise when its fingerprint is this
    machine's and it names this machine or none (files recorded before the machine was)."""
    mine = want.get("other_machines", {}).get(got["machine"])
    if mine is not None and mine["kernels"] == got["kernels"]:
        return mine["metrics"], True
    same = got["kernels"] == want["kernels"] and want.get("machine", got["machine"]) == got["machine"]
    return want["metrics"], same


def main(argv: list[str]) -> int:
    """``[--this-machine] [CASE ...]``: (re)record the cases; ``--this-machine`` keeps each file's recording and
    adds this machine's beside it (``other_machines``), for a machine that rounds otherwise under the same code."""
    this_machine = "--this-machine" in argv
    names = [a for a in argv if a != "--this-machine"] or list(CASES)
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"golden-{name}-") as tmp:
            result = run_case(name, Path(tmp))
        if this_machine:
            kept = json.loads(golden_path(name).read_text())
            if kept["overrides"] != result["overrides"]:
                raise SystemExit(f"{name}: the case changed since its file was recorded: record it anew")
            mine = {"kernels": result["kernels"], "metrics": result["metrics"]}
            result = {**kept, "other_machines": {**kept.get("other_machines", {}), result["machine"]: mine}}
        golden_path(name).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        losses = [float.fromhex(v) for v in (mine if this_machine else result)["metrics"]["train/loss"].values()]
        print(f"{name}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
