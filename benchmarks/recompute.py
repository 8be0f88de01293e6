"""Activation recomputation (``./launch.sh bench --recompute``): peak memory and step time of a plain training step
(forward, backward, AdamW) with ``train.activation_checkpointing`` none, full and selective, on the configured
model (default: the demo decoder) and a larger CPU model (``LARGER``).

Each (model, mode) runs in its own process, so the peak is that mode's alone: on CPU the process's peak resident
set (``ru_maxrss``: weights, AdamW state and activations; the modes differ by their activations only), on CUDA
``max_memory_allocated``. Step time: the best of ``rounds`` rounds of ``steps`` steps after two warm-up steps.
The first step's loss of each mode is reported relative to ``none`` (recomputation must not change it).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from pretrain.config import RunConfig, load_config

MODES = ("none", "full", "selective")
LARGER = [
    "model.num_layers=8",
    "model.hidden_size=512",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.max_seq_len=256",
    "train.micro_batch_size=8",
]
"""A larger CPU model: ~4x the demo decoder's width x depth at twice its sequence length."""


def _measure(cfg: RunConfig, mode: str, steps: int, rounds: int) -> dict:
    """In this process: peak memory, best step time and first loss of ``mode`` on ``cfg``'s model."""
    from benchmarks.common import random_batches, sync
    from pretrain.model import build_model, param_groups
    from pretrain.train.engine import build_optimizer

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    model = build_model(cfg.model, cfg.train.seed, cfg.moe).to(device).train()
    model.activation_checkpointing = mode
    opt = build_optimizer(param_groups(model, cfg.train.weight_decay), cfg)
    batches = random_batches(cfg, steps, device)

    def step(batch) -> float:
        loss = model(batch["input_ids"], labels=batch["labels"]).objective()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    first = step(batches[0])
    step(batches[1 % steps])
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    best = float("inf")
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for b in batches:
            step(b)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / steps)
    peak = (
        torch.cuda.max_memory_allocated(device) if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )  # Linux: KiB
    return {"peak_mb": peak / 2**20, "step_s": best, "first_loss": first}


def recompute_bench(path: str | Path, overrides: list[str], steps: int, rounds: int) -> dict:
    """{"recompute_<model>": {mode: ...}} for the configured model and ``LARGER``, each mode in a subprocess."""
    out: dict = {}
    for name, extra in (("config", []), ("larger", LARGER)):
        rows = {}
        for mode in MODES:
            args = [
                sys.executable,
                "-m",
                "benchmarks.recompute",
                str(path),
                str(steps),
                str(rounds),
                mode,
                *overrides,
                *extra,
            ]
            proc = subprocess.run(args, capture_output=True, text=True, check=False)
            if proc.returncode:
                raise RuntimeError(f"bench --recompute {name} {mode} failed:\n{proc.stderr[-2000:]}")
            rows[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        ref = rows["none"]
        out[f"recompute_{name}_peak_mb"] = {m: r["peak_mb"] for m, r in rows.items()}
        out[f"recompute_{name}_step_s"] = {m: r["step_s"] for m, r in rows.items()}
        out[f"recompute_{name}_loss_rel_diff"] = {
            m: abs(r["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"]) for m, r in rows.items()
        }
    return out


if __name__ == "__main__":  # one (model, mode): python -m benchmarks.recompute CONFIG STEPS ROUNDS MODE [k=v ...]
    config, n, r, m, *over = sys.argv[1:]
    c = load_config(config, over)
    c.model.vocab_size = c.model.vocab_size or c.data.tokenizer_vocab_size  # random tokens: no tokenizer needed
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(json.dumps(_measure(c, m, int(n), int(r))))
