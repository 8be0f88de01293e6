"""The memory plan (``pretrain/driver/memory_plan.py``, what ``train --dry-run`` prints) against the memory training
actually allocates: a few fp32 steps of the demo decoder and encoder on CPU through the real DeepSpeed engine (ZeRO-1,
one rank; and 2 ranks with sequence or tensor parallelism), the estimate's total within 20 % of the measured peak.

How the peak is measured: CPU has no allocator statistics (``torch.cuda.max_memory_allocated``), and the process's
resident set also counts the Python heap, libraries and freed pages malloc keeps. The torch profiler with
``profile_memory=True`` instead records every allocation and free of tensor memory through torch's CPU allocator,
with its size; their running sum from the profiler's start is the tensor memory alive at each moment. The module is
built inside the profiled window (weights, the ZeRO flat buffers, the fp32 partition, later the AdamW moments all
count), and the peak is the largest running sum during the training steps, which is what the estimate models:
weights + gradients + optimizer states + one micro-batch's activations at the backward's peak.
"""

from __future__ import annotations

import pytest

from tests.harness import run_distributed, tiny_model

DEMO = [  # big enough that weights and activations dwarf the small tensors the estimate leaves out
    *tiny_model(vocab_size=4096, hidden_size=256, num_layers=4, max_seq_len=128, num_heads=None),
    "train.micro_batch_size=16",
    "train.global_batch_size=16",
    "train.precision=fp32",
    "train.compile=no",
    "zero.stage=1",
    "zero.reduce_bucket_size=2000000",  # (see the test)
    "stability.health_every=0",  # the measured steps run no health probe: its copies are not in the estimate
]
CASES = {
    "demo-decoder": ("demo-decoder", []),
    "demo-encoder": ("demo-encoder", []),
    "demo-decoder-full": ("demo-decoder", ["train.activation_checkpointing=full"]),
    "demo-decoder-selective": ("demo-decoder", ["train.activation_checkpointing=selective"]),
    "demo-decoder-accumulation": ("demo-decoder", ["train.micro_batch_size=8"]),
    # bf16 ZeRO-1: the bf16 gradients, their fp32 sum (BF16_Optimizer) and its fp32 reduction
    "demo-decoder-bf16-accumulation": ("demo-decoder", ["train.precision=bf16", "train.micro_batch_size=8"]),
    # a small vocabulary: the peak comes once gradients exist, while the last block is rebuilt
    "demo-decoder-full-vocab-512": ("demo-decoder", ["train.activation_checkpointing=full", "model.vocab_size=512"]),
    "demo-moe": ("demo-moe", []),
    "demo-moe-encoder": ("demo-moe-encoder", []),
}
MODEL_PARALLEL = ["cluster.num_workers=2", "data.num_streams=1"]
PARALLEL_CASES = {  # 2 workers: the estimate of each rank against its own measured peak
    "demo-decoder-sp2": ("demo-decoder", [*MODEL_PARALLEL, "parallel.sequence=2"]),
    "demo-encoder-tp2": ("demo-encoder", [*MODEL_PARALLEL, "parallel.tensor=2"]),
    "demo-decoder-tp2-selective": (
        "demo-decoder",
        [*MODEL_PARALLEL, "parallel.tensor=2", "train.activation_checkpointing=selective"],
    ),
}
STEPS = 2


def _peak_bytes(events, window: str) -> tuple[int, int]:
    """(tensor bytes alive when ``window`` starts, the most alive during it) from the profiler's memory events."""
    span = next(e for e in events if e.name() == window)
    alive = start = peak = 0
    for ts, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        alive += nbytes
        if ts < span.start_ns():
            start = alive
        elif ts <= span.end_ns():
            peak = max(peak, alive)
    return start, peak


def measure(rank: int, world: int, cases: dict) -> dict:
    """In a process of ``run_distributed``: for each case, build the module and train ``STEPS`` steps under the
    profiler; the measured peak and the plan's estimate (bytes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from pretrain.config import load_config, make_plan
    from pretrain.driver.memory_plan import count_parameters, layout_of, memory
    from pretrain.train.module import build_module
    from tests.conftest import ROOT
    from tests.harness import train_steps

    out = {}
    for name, (preset, overrides) in cases.items():
        cfg = load_config(ROOT / "configs" / f"{preset}.yaml", [*DEMO, *overrides])
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, cfg.model.vocab_size, (16, 128), generator=g) for _ in range(STEPS)]
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            module = build_module(cfg)
            with record_function("training steps"):
                train_steps(module, batches, rank, world)
        del module
        built, peak = _peak_bytes(prof.profiler.kineto_results.events(), "training steps")
        mem = memory(cfg, count_parameters(cfg), layout_of(cfg, make_plan(cfg, world)))
        out[name] = {"built": built, "peak": peak, "estimate": mem.total, **mem.parts()}
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_distributed(measure, 1, CASES, fresh=False)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_is_within_20_percent_of_the_measured_peak(measured, case):
    r = {k: v / 2**20 for k, v in measured[case].items()}  # MiB
    report = ", ".join(f"{k} {v:.1f}" for k, v in r.items())
    assert abs(r["estimate"] - r["peak"]) <= 0.2 * r["peak"], f"{case} (MiB): {report}"


@pytest.fixture(scope="module")
def measured_parallel() -> list[dict]:
    return run_distributed(measure, 2, PARALLEL_CASES, fresh=False)


@pytest.mark.parametrize("case", list(PARALLEL_CASES))
def test_the_estimate_holds_per_rank_under_sequence_and_tensor_parallelism(measured_parallel, case):
    for rank, ranks in enumerate(measured_parallel):
        r = {k: v / 2**20 for k, v in ranks[case].items()}  # MiB
        report = ", ".join(f"{k} {v:.1f}" for k, v in r.items())
        assert abs(r["estimate"] - r["peak"]) <= 0.2 * r["peak"], f"{case} rank {rank} (MiB): {report}"
