"""The step benchmark (``./launch.sh bench``; arguments and modes: :mod:`benchmarks.cli`), measured in one run: our
training step (DeepSpeed engine, as configured) against a bare PyTorch loop on the same model, batch and optimizer, the
overhead of the stability health metrics at their default interval (``health_overhead_frac``), plus data-pipeline
throughput; then the real training loop of the same config (``python -m pretrain train``: data, callbacks, health,
logging, MLflow, Ray) on the same model, batch and threads: ``loop_tokens_per_s``, ``loop_vs_step_ratio`` (against the
mean of the step timed before the loop and again after it: :func:`step_after_loop`) and ``time_to_first_step_s`` with
its phases (:mod:`benchmarks.loop`; ``--no-loop`` skips it).

Our step is timed without and with compiled blocks (``train.compile``), with the one-time compile cost.
MFU = model FLOPs/s over the matmul peak this device measurably reaches in the run's precision (fp32 on CPU,
bf16 on GPUs), and on known GPUs also over the datasheet dense bf16 peak (``mfu_vs_datasheet``).

CPU: the demo decoder (configs/demo-decoder.yaml). GPU: a ~125M decoder (configs/gpt-125m.yaml model) in bf16.

    ./launch.sh bench [--json] [--steps N] [--loop-steps N] [--no-loop] [CONFIG] [key=value ...]
    ./launch.sh bench --recompute [CONFIG] [key=value ...]   activation checkpointing none/full/selective
    ./launch.sh bench --vs-hf [--repeats N] [--corpus PATH] [--loop-steps N] [CONFIG] [key=value ...]
                                                           ours vs HF Trainer
    ./launch.sh bench --no-moe --workers 2 zero.stage=2    the loop on 2 workers (ZeRO-1/2), its ratio to its step
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any, Literal, cast

import torch

from benchmarks.common import bench_tokens, interleaved_best, micro_batch_module, train_step_fn
from benchmarks.common import random_batches as _batches
from benchmarks.common import sync as _sync
from pretrain.config import RunConfig, load_config
from pretrain.model.peak import datasheet_peak, measured_matmul_peak

ROOT = Path(__file__).resolve().parents[1]


def _bare_step_fn(cfg: RunConfig, device: torch.device, precision: str):
    """The reference: a plain PyTorch step (autocast for bf16, clip, AdamW)."""
    from pretrain.model import build_model, param_groups
    from pretrain.train.engine import build_optimizer

    model = build_model(cfg.model, cfg.train.seed, cfg.moe).to(device)
    model.activation_checkpointing = cast(str, cfg.train.activation_checkpointing)  # str after __post_init__
    opt = build_optimizer(param_groups(model, cfg.train.weight_decay), cfg)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step(batch):
        with amp:
            loss = model(batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        if cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _our_step_fn(cfg: RunConfig, device: torch.device, compile: Literal["auto", "yes", "no"]):
    return train_step_fn(micro_batch_module(_with_compile(cfg, compile), device))


def _with_compile(cfg: RunConfig, compile: Literal["auto", "yes", "no"]) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=compile))


def step_benchmark(cfg: RunConfig, device: torch.device, precision: str, steps: int, rounds: int) -> dict:
    """Our step without and with compiled blocks vs a bare eager PyTorch step, interleaved in one run; the default
    (``train.compile`` as configured) is what ``tokens_per_s`` and ``ratio_vs_bare_pytorch`` report."""
    from pretrain.model.compile import compile_supported
    from pretrain.train.module import compile_wanted

    batches = _batches(cfg, steps, device)
    fns = [_bare_step_fn(cfg, device, precision), _our_step_fn(cfg, device, "no")]
    can_compile, why_not = compile_supported(device)
    compile_s = None
    if can_compile:
        compiled = _our_step_fn(cfg, device, "yes")
        _sync(device)
        t0 = time.perf_counter()
        compiled(batches[0])  # the one-time compile (forward and backward graphs of each block shape)
        _sync(device)
        first = time.perf_counter() - t0
        fns.append(compiled)
    times = interleaved_best(fns, batches, device, rounds)
    tokens = bench_tokens(cfg, steps)
    bare, eager = tokens / times[0], tokens / times[1]
    out: dict[str, Any] = {
        "bare_pytorch_tokens_per_s": bare,
        "eager_tokens_per_s": eager,
        "eager_ratio_vs_bare_pytorch": eager / bare,
    }
    if can_compile:
        out["compiled_tokens_per_s"] = tokens / times[2]
        out["compiled_ratio_vs_bare_pytorch"] = out["compiled_tokens_per_s"] / bare
        compile_s = max(first - times[2] / steps, 0.0)
    else:
        out["compiled_ratio_vs_bare_pytorch"] = None
        out["compile_unavailable"] = why_not
    default_compiled = can_compile and compile_wanted(cfg.train.compile, device, cfg.zero.stage)
    out["compile_default"] = "yes" if default_compiled else "no"
    out["tokens_per_s"] = out["compiled_tokens_per_s"] if default_compiled else eager
    out["ratio_vs_bare_pytorch"] = out["tokens_per_s"] / bare
    out.update({"compile_s": compile_s, "steps_per_round": steps, "rounds": rounds})
    return out


def step_after_loop(cfg: RunConfig, device: torch.device, before: dict, steps: int, rounds: int) -> dict:
    """Our default step timed again, right after the real loop, as it was before it (``before``: the step and
    loop results so far); the loop is then compared with the mean of the two. A machine's speed can drift by
    several percent over minutes (thermal limits, other load), and the loop runs between the two timings, so the
    mean is the step at the loop's time as near as one run can tell."""
    step = _our_step_fn(cfg, device, before["compile_default"])
    after = bench_tokens(cfg, steps) / interleaved_best([step], _batches(cfg, steps, device), device, rounds)[0]
    reference = (before["tokens_per_s"] + after) / 2
    return {
        "step_tokens_per_s_after_loop": after,
        "loop_step_reference_tokens_per_s": reference,
        "loop_vs_step_ratio": before["loop_tokens_per_s"] / reference,
        "loop_mean_vs_step_ratio": before["loop_mean_tokens_per_s"] / reference,
    }


def health_overhead(cfg: RunConfig, device: torch.device, precision: str, pairs: int) -> dict:
    """Cost of the health metrics at the default interval: our guarded step (stability checks on) with
    and without a :class:`HealthProbe`, interleaved; overhead = extra time of one health step spread over
    ``stability.health_every`` steps, as a fraction of the step time."""
    from pretrain.train.callbacks.health import HealthCallback
    from pretrain.train.health import HealthProbe
    from pretrain.train.stability.monitor import StabilityMonitor
    from pretrain.train.step import StepHooks, StepInput, run_step

    module = micro_batch_module(cfg, device)
    monitor = StabilityMonitor(cfg.stability)
    guard = StepHooks()
    guard.decide = monitor.decide  # type: ignore[method-assign, assignment]  # deliberate: the monitor decides
    probes = HealthCallback(every=1)
    batches = _batches(cfg, 2, device)
    step_no = 0

    def timed(probe: bool) -> float:
        nonlocal step_no
        step_no += 1
        probes.probe = HealthProbe(module.engine, module.plan.dims) if probe else None
        _sync(device)
        t0 = time.perf_counter()
        run_step(module, StepInput(step_no, batches[step_no % 2], cfg.train.lr), [guard, probes])
        _sync(device)
        return time.perf_counter() - t0

    timed(False), timed(True)  # warm-up
    plain, health = [], []
    for _ in range(pairs):
        plain.append(timed(False))
        health.append(timed(True))
    step_s, extra = statistics.median(plain), statistics.median(health) - statistics.median(plain)
    every = cfg.stability.health_every
    return {
        "health_every": every,
        "step_s": step_s,
        "health_step_extra_s": extra,
        "health_overhead_frac": max(extra, 0.0) / (every * step_s) if every else 0.0,
    }


def data_benchmark(cfg: RunConfig, seconds: float) -> float:
    from pretrain.config.paths import resolve_paths
    from pretrain.data import data_throughput, load_or_train_tokenizer

    cfg = resolve_paths(cfg)
    tok_dir = Path(cfg.data.cache_dir) / "bench-tokenizer"
    if not cfg.data.tokenizer:
        if (tok_dir / "tokenizer.json").is_file():
            cfg.data.tokenizer = str(tok_dir)
        else:
            load_or_train_tokenizer(cfg.data, out_dir=tok_dir)
            cfg.data.tokenizer = str(tok_dir)
    tokenizer = load_or_train_tokenizer(cfg.data)
    return data_throughput(
        cfg.data, kind=cfg.model.kind, seq_len=cfg.model.max_seq_len, tokenizer=tokenizer, seconds=seconds
    )


def run_bench(cfg: RunConfig, steps: int, rounds: int) -> dict:
    from pretrain.model import build_model, flops_per_token, num_parameters
    from pretrain.train import dist
    from pretrain.train.engine import resolve_precision

    ctx = dist.setup(cfg.cluster.use_gpu)
    device = ctx.device
    if device.type == "cpu":
        torch.set_num_threads(cfg.train.num_threads or len(os.sched_getaffinity(0)))
    if cfg.train.reuse_host_memory:  # as the training worker does; the bare PyTorch step runs in this process too
        from pretrain.train.host_memory import keep_freed_host_memory

        keep_freed_host_memory()
    precision = resolve_precision(cfg.train.precision, device)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = -(-cfg.data.tokenizer_vocab_size // cfg.model.vocab_multiple) * cfg.model.vocab_multiple
    with torch.device("meta"):
        n_params = num_parameters(build_model(cfg.model, 0, cfg.moe))
    result: dict = {
        "config": cfg.name,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)",
        "precision": precision,
        "zero_stage": cfg.zero.stage,
        "params": n_params,
        "seq_len": cfg.model.max_seq_len,
        "micro_batch_size": cfg.train.micro_batch_size,
    }
    result.update(step_benchmark(cfg, device, precision, steps, rounds))
    result.update(health_overhead(cfg, device, precision, pairs=max(3, steps // 2)))
    fpt = flops_per_token(cfg.model, cfg.model.max_seq_len, cfg.moe)
    result["model_flops_per_token"] = fpt
    result["achieved_tflops"] = fpt * result["tokens_per_s"] / 1e12
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    measured = measured_matmul_peak(device, dtype)
    result["measured_matmul_peak_tflops"] = measured / 1e12
    result["mfu"] = fpt * result["tokens_per_s"] / measured  # against what this device's matmul reaches
    result["bare_pytorch_mfu"] = fpt * result["bare_pytorch_tokens_per_s"] / measured
    sheet = datasheet_peak(result["device"]) if device.type == "cuda" and precision == "bf16" else None
    if sheet:
        result["datasheet_peak_tflops"] = sheet / 1e12
        result["mfu_vs_datasheet"] = fpt * result["tokens_per_s"] / sheet
    result["data_tokens_per_s_per_core"] = data_benchmark(cfg, seconds=3.0)
    return result


def run_moe_bench(cfg: RunConfig, overrides: list[str], steps: int, rounds: int, gpu: bool) -> dict:
    """The MoE part: the bench config when it is MoE, else configs/demo-moe.yaml (see benchmarks/moe.py)."""
    from benchmarks.moe import all_to_all_share, moe_vs_dense
    from pretrain.train import dist
    from pretrain.train.engine import resolve_precision

    if not cfg.moe.enabled:
        cfg = load_config(ROOT / "configs" / "demo-moe.yaml", [o for o in overrides if not o.startswith("model.")])
        cfg.train.global_batch_size = cfg.train.micro_batch_size
        cfg.data.num_streams = 1
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = -(-cfg.data.tokenizer_vocab_size // cfg.model.vocab_multiple) * cfg.model.vocab_multiple
    device = dist.setup(cfg.cluster.use_gpu).device
    out = moe_vs_dense(cfg, device, resolve_precision(cfg.train.precision, device), steps, rounds)
    if gpu or cfg.moe.num_experts % 2:  # EP=2 needs a second GPU (the CPU figure would not compare) / even E
        out["moe_all_to_all_frac"] = None
    else:
        out.update(all_to_all_share(cfg, steps))
    return out
