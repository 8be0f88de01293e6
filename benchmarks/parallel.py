"""``./launch.sh bench --parallel``: sequence parallelism (DeepSpeed Ulysses) and tensor parallelism (DeepSpeed AutoTP)
on the demo decoder, all measured in this run on real gloo workers (CPU), one optimizer step per timed call:

- per layout (1 worker; 2 workers with ``parallel.sequence=2``; 2 workers with ``parallel.tensor=2``)
  at the same sequence length and global batch: tokens/s, and each rank's peak resident memory (``ru_maxrss``:
  the process's whole footprint, Python and torch included);
- ``*_comm_frac``: the share of the step's wall time inside DeepSpeed's Ulysses all-to-alls (sequence parallel) or
  AutoTP's all-reduces (tensor parallel), forward and backward, including the wait for the slower peer, mean over
  ranks;
- ``longest_seq_len``: the longest ``model.max_seq_len`` whose dry-run memory plan (``pretrain/driver/memory_plan.py``,
  checked against measured memory in ``tests/integration/train/test_memory_plan.py``) fits a worker's share of this
  machine's memory, per layout.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import sys
import time

import torch

from pretrain.config import RunConfig, load_config, make_plan, to_dict

LAYOUTS = {"n1": (1, 1, 1), "sp2": (2, 2, 1), "tp2": (2, 1, 2)}
"""name -> (workers, parallel.sequence, parallel.tensor)."""


def _timed(totals: list[float], fn, keep):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not keep(*args, **kwargs):
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[0] += time.perf_counter() - t0

    return wrapper


def _install_timers() -> list[float]:
    """Time Ulysses' all-to-alls and AutoTP's all-reduces (:func:`pretrain.ds_adapter.time_model_parallel_collectives`);
    the running total is ``[0]`` of the returned list."""
    from pretrain import ds_adapter

    totals = [0.0]
    ds_adapter.time_model_parallel_collectives(functools.partial(_timed, totals))
    return totals


def _worker(rank: int, world: int, cfg_dict: dict, steps: int) -> dict:
    from pretrain.config import from_dict
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    cfg = from_dict(cfg_dict)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's op-build line is no result (``--json`` on stdout)
        module = build_module(cfg)
    totals = _install_timers()
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.global_batch_size, cfg.model.max_seq_len)
    batches = [torch.randint(0, cfg.model.vocab_size, shape, generator=g) for _ in range(steps + 1)]

    def step(i: int) -> None:
        run_step(module, StepInput(i + 1, {"input_ids": batches[i], "labels": batches[i]}, 1e-4))

    step(0)  # warm-up
    totals[0] = 0.0
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step(i)
    total = time.perf_counter() - t0
    return {
        "step_s": total / steps,
        "comm_frac": totals[0] / total,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def bench_config(path: str, overrides: list[str], seq_len: int, layout: tuple[int, int, int]) -> RunConfig:
    workers, sp, tp = layout
    return load_config(
        path,
        [
            "model.vocab_size=4096",  # no tokenizer needed
            "train.precision=fp32",
            "model.dropout=0.0",
            "zero.stage=1",
            "train.global_batch_size=1",
            "train.micro_batch_size=1",
            "data.num_streams=1",
            "train.val_sequences=1",
            *overrides,
            f"model.max_seq_len={seq_len}",
            f"cluster.num_workers={workers}",
            f"parallel.sequence={sp}",
            f"parallel.tensor={tp}",
        ],
    )


def longest_seq_len(path: str, overrides: list[str], layout: tuple[int, int, int], budget: float) -> int:
    """The longest ``max_seq_len`` (a multiple of 256) whose planned peak per worker stays within ``budget`` bytes."""
    from pretrain.driver.memory_plan import count_parameters, layout_of, memory

    def fits(n: int) -> bool:
        cfg = bench_config(path, overrides, n, layout)
        return memory(cfg, count_parameters(cfg), layout_of(cfg, make_plan(cfg, layout[0]), gpus=False)).total <= budget

    lo, hi = 256, 256
    while fits(hi * 2) and hi < 2**24:
        hi *= 2
    lo = hi
    hi = hi * 2
    while hi - lo > 256:
        mid = (lo + hi) // 512 * 256
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def parallel_bench(path: str, overrides: list[str], seq_len: int, steps: int) -> dict:
    from pretrain.train.spawn import run_distributed

    out: dict = {"parallel_config": os.path.basename(path), "parallel_seq_len": seq_len, "parallel_steps": steps}
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out["host_memory_gib"] = memory_bytes / 2**30
    for name, layout in LAYOUTS.items():
        cfg = bench_config(path, overrides, seq_len, layout)
        ranks = run_distributed(_worker, layout[0], to_dict(cfg), steps)
        step_s = max(r["step_s"] for r in ranks)
        out[f"{name}_tokens_per_s"] = seq_len * cfg.train.global_batch_size / step_s
        out[f"{name}_peak_rss_gib"] = max(r["peak_rss_gib"] for r in ranks)
        if name != "n1":
            out[f"{name}_comm_frac"] = sum(r["comm_frac"] for r in ranks) / len(ranks)
        # the plan's longest sequence with this machine's memory shared by the layout's workers (90% of it)
        out[f"{name}_longest_seq_len"] = longest_seq_len(path, overrides, layout, 0.9 * memory_bytes / layout[0])
    out["sp2_vs_n1_tokens_per_s"] = out["sp2_tokens_per_s"] / out["n1_tokens_per_s"]
    out["tp2_vs_n1_tokens_per_s"] = out["tp2_tokens_per_s"] / out["n1_tokens_per_s"]
    return out
