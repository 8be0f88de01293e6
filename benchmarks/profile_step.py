"""Where the time of one training step goes: ``python -m benchmarks.profile_step [--compiled] [CONFIG] [key=value
...]``.

Profiles a few steps of our step function (eager, or with compiled blocks) on the bench's fixed batches with the
torch profiler and prints the self time by operator class (matmuls, attention, elementwise/norm, loss, optimizer,
other), the evidence for what compilation can and cannot speed up; ``--trace FILE`` also writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

from benchmarks.common import micro_batch_module, random_batches, train_step_fn
from pretrain.config import load_config

ROOT = Path(__file__).resolve().parents[1]

_CLASSES = [  # (class, substrings of aten op names); the first match wins
    ("matmul", ("mm", "addmm", "bmm", "matmul", "linear", "grouped_mm")),
    ("attention", ("scaled_dot_product", "flash", "_efficient_attention", "sdpa")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy", "logsumexp")),
    ("optimizer", ("adam", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt")),
    ("compiled kernels", ("cpp_fused", "triton_", "CompiledFunction", "Torch-Compiled")),
]


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in _CLASSES:
        if any(k in low for k in keys):
            return cls
    return "elementwise/norm/other"


def profile(cfg, compiled: bool, steps: int, trace: str = "") -> dict[str, float]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from pretrain.train import dist

    device = dist.setup(cfg.cluster.use_gpu).device
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile="yes" if compiled else "no"))
    step = train_step_fn(micro_batch_module(cfg, device))
    batches = random_batches(cfg, steps + 2, device)
    for b in batches[:2]:
        step(b)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for b in batches[2:]:
            step(b)
    if trace:
        prof.export_chrome_trace(trace)
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.key.startswith("aten::") or "cpp_fused" in evt.key or "triton" in evt.key:
            us = evt.self_device_time_total if device.type == "cuda" else evt.self_cpu_time_total
            totals[classify(evt.key)] = totals.get(classify(evt.key), 0.0) + us / 1e6 / steps
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step")
    p.add_argument("--compiled", action="store_true", help="with compiled blocks (train.compile=yes)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--trace", default="", help="also write a Chrome trace (JSON) here")
    p.add_argument("rest", nargs="*", help="CONFIG.yaml and key=value overrides")
    a = p.parse_args(argv)
    path = next((r for r in a.rest if "=" not in r), ROOT / "configs" / "demo-decoder.yaml")
    cfg = load_config(path, [r for r in a.rest if "=" in r])
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = cfg.data.tokenizer_vocab_size
    cfg.train.global_batch_size, cfg.data.num_streams = cfg.train.micro_batch_size, 1
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        totals = profile(cfg, a.compiled, a.steps, a.trace)
    total = sum(totals.values())
    print(
        json.dumps(
            {"step_s_profiled_ops": total, **{k: {"s": v, "share": v / total} for k, v in totals.items()}}, indent=1
        ),
        file=out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
