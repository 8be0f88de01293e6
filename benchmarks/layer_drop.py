"""Layer-dropout speed (``./launch.sh bench --layer-drop``), measured in one run: our training step at layer-drop
rates 0, 0.25 and 0.5 (``layer`` mode, block granularity, constant schedule) on the same model and batches,
interleaved best-of-N rounds. Each rate replays the same drop pattern every round (steps 1..N), and the report
gives the blocks that actually ran, the speed-up over rate 0, and its ratio to the ideal 1 / (1 - rate)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from benchmarks.common import bench_tokens, interleaved_best, micro_batch_module, random_batches
from pretrain.config import RunConfig

RATES = (0.0, 0.25, 0.5)


def _step_fn(cfg: RunConfig, device: torch.device, steps: int):
    from pretrain.train.callbacks.layer_drop import LayerDropCallback
    from pretrain.train.step import StepInput, run_step

    module = micro_batch_module(cfg, device)
    hooks = [LayerDropCallback(module.cfg, 0, module.plan.micro_batch_ids(0))] if cfg.layer_drop.enabled else []
    numbers = itertools.cycle(range(1, steps + 1))  # every round replays steps 1..N: the same blocks run

    def step(batch):
        n = next(numbers)
        for h in hooks:
            h.on_step_start(None, n)
        return run_step(module, StepInput(n, batch, cfg.train.lr), hooks).loss

    return step


def active_fraction(cfg: RunConfig, steps: int) -> float:
    """Mean fraction of the blocks that run over steps 1..N (the drop pattern the timed rounds replay)."""
    from pretrain.model.layerdrop import executed_blocks, training_gates

    if not cfg.layer_drop.enabled:
        return 1.0
    runs = [
        len(executed_blocks(training_gates(cfg.layer_drop, cfg.train.seed, s, cfg.model.num_layers)))
        for s in range(steps)
    ]
    return sum(runs) / (steps * cfg.model.num_layers)


def layer_drop_bench(cfg: RunConfig, device: torch.device, steps: int, rounds: int) -> dict:
    variants = [
        dataclasses.replace(
            cfg,
            layer_drop=dataclasses.replace(
                cfg.layer_drop, rate=r, mode="layer", granularity="block", schedule="constant"
            ),
        )
        for r in RATES
    ]
    batches = random_batches(cfg, steps, device)
    # Warm-up covers 2 steps per variant; the closures' step counters then restart at a round boundary.
    times = interleaved_best([_step_fn(v, device, steps) for v in variants], batches, device, rounds)
    tokens = bench_tokens(cfg, steps)
    tps = {f"{r:g}": tokens / t for r, t in zip(RATES, times)}
    out: dict = {
        "layer_drop_tokens_per_s": tps,
        "layer_drop_active_fraction": {},
        "layer_drop_speedup": {},
        "layer_drop_vs_ideal": {},
    }
    for r, v in zip(RATES, variants):
        key = f"{r:g}"
        speedup = tps[key] / tps["0"]
        out["layer_drop_active_fraction"][key] = active_fraction(v, steps)
        out["layer_drop_speedup"][key] = speedup
        out["layer_drop_vs_ideal"][key] = speedup * (1.0 - r)
    return out
