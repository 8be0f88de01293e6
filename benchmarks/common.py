"""Helpers shared by the benchmarks (:mod:`benchmarks.step`, :mod:`benchmarks.moe`): fixed random batches and
interleaved best-of-N timing. Imports neither benchmark, so ``bench -> bench_moe -> bench_common`` has no cycle."""

from __future__ import annotations

import dataclasses
import time

import torch

from pretrain.config import RunConfig


def micro_batch_config(cfg: RunConfig, world_size: int = 1) -> RunConfig:
    """``cfg`` with one micro-batch per worker per optimizer step (the unit the benchmarks time): the global batch
    is ``micro x workers`` over as many data streams."""
    t = cfg.train
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(t, global_batch_size=t.micro_batch_size * world_size),
        data=dataclasses.replace(cfg.data, num_streams=world_size),
        cluster=dataclasses.replace(cfg.cluster, num_workers=world_size),
    )


def bench_tokens(cfg: RunConfig, steps: int, world_size: int = 1) -> int:
    """Tokens in ``steps`` benchmark steps of ``cfg`` (from the run plan of :func:`micro_batch_config`)."""
    from pretrain.config import make_plan

    return steps * make_plan(micro_batch_config(cfg, world_size), world_size).tokens_per_step


def micro_batch_module(cfg: RunConfig, device: torch.device, world_size: int = 1):
    """The training module of :func:`micro_batch_config`. torch.distributed must be up."""
    from pretrain.train.module import build_module

    return build_module(micro_batch_config(cfg, world_size), device=device)


def train_step_fn(module, hooks=()):
    """``step(batch) -> loss``: one optimizer step of ``module`` at the peak LR on a micro-batch."""
    from pretrain.train.step import StepInput, run_step

    lr = module.cfg.train.lr
    return lambda batch: run_step(module, StepInput(1, batch, lr), hooks).loss


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so wall-clock timings are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_batches(cfg: RunConfig, n: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """``n`` fixed (seed 0) random token batches of the configured micro batch and sequence length on ``device``;
    labels are the inputs (decoder) or the inputs with ~85% masked to -100 (encoder, MLM-like)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.max_seq_len), generator=g)
        labels = ids.clone()
        if cfg.model.kind == "encoder":
            labels[torch.rand(ids.shape, generator=g) > 0.15] = -100
        out.append({"input_ids": ids.to(device), "labels": labels.to(device)})
    return out


def _time_steps(step, batches, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    sync(device)
    return time.perf_counter() - t0


def interleaved_best(fns: list, batches, device: torch.device, rounds: int) -> list[float]:
    """Warm each step function up on two batches, then time ``rounds`` interleaved rounds over ``batches`` so
    drift (thermal, other load) hits all alike; the best round per function (the least disturbed one)."""
    for fn in fns:  # warm-up (allocator, kernels, DeepSpeed buffers)
        _time_steps(fn, batches[:2], device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t.append(_time_steps(fn, batches, device))
    return [min(t) for t in times]
