"""MoE benchmark (part of ``./launch.sh bench``), all measured in this run:

- ``moe_vs_dense_active_ratio``: tokens/s of our training step on the MoE model over the same model with a dense
  FFN of the same *active* size (``top_k * moe.ffn_size``; same attention, embeddings, everything else), one
  worker, interleaved best-of-N rounds. The MoE step pays for routing, sorting/gathering tokens and the per-expert
  loop, which a dense FFN does not;
- ``moe_all_to_all_frac``: with ``parallel.expert = 2`` on 2 real gloo workers, the share of the step's wall time
  spent inside the token all-to-alls (forward and backward, including the wait for the slower peer), mean over
  ranks of the timed steps.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from benchmarks.common import bench_tokens, interleaved_best, micro_batch_module, random_batches, train_step_fn
from pretrain.config import RunConfig


def _no_twin(cfg: RunConfig) -> str:
    """Why ``cfg`` has no dense twin ('' when it has one): the model has one FFN size for all blocks, so only a
    model with MoE in every block has a dense twin of its active size."""
    if cfg.moe.layers or cfg.moe.every != 1:
        return "MoE in some blocks only (moe.every / moe.layers): no dense model of the same active size"
    return ""


def _dense_twin(cfg: RunConfig) -> RunConfig:
    """The same model with every MoE FFN replaced by a dense FFN of the active size (top_k experts, each of the
    width the MoE layer resolves: ``moe.ffn_size``, else the model's FFN width)."""
    twin = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model), moe=dataclasses.replace(cfg.moe))
    twin.model.ffn_size = cfg.moe.top_k * (cfg.moe.ffn_size or cfg.model.ffn_width())
    twin.moe.num_experts = 0
    return twin


def _step_fn(cfg: RunConfig, device: torch.device, precision: str):
    return train_step_fn(micro_batch_module(cfg, device))


def moe_vs_dense(cfg: RunConfig, device: torch.device, precision: str, steps: int, rounds: int) -> dict:
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, expert=1))
    batches = random_batches(cfg, steps, device)
    why = _no_twin(cfg)
    fns = [_step_fn(cfg, device, precision)] + ([] if why else [_step_fn(_dense_twin(cfg), device, precision)])
    times = interleaved_best(fns, batches, device, rounds)
    tokens = bench_tokens(cfg, steps)
    t_moe, t_dense = times[0], (times[1] if len(times) > 1 else None)
    return {
        "moe_config": cfg.name,
        "moe_experts": cfg.moe.num_experts,
        "moe_top_k": cfg.moe.top_k,
        "moe_tokens_per_s": tokens / t_moe,
        "moe_dense_active_tokens_per_s": tokens / t_dense if t_dense else None,
        "moe_vs_dense_active_ratio": t_dense / t_moe if t_dense else None,
        **({"moe_vs_dense_why_not": why} if why else {}),
    }


def _ep_worker(rank: int, world: int, cfg_dict: dict, steps: int) -> dict:
    from pretrain.config import from_dict
    from pretrain.parallel.expert import exchanges

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    cfg = from_dict(cfg_dict)
    device = torch.device("cpu")
    module = micro_batch_module(cfg, device, world)
    step = train_step_fn(module)
    batches = random_batches(cfg, steps + 2, device)
    timers = exchanges(module.model)
    for b in batches[:2]:  # warm-up
        step(b)
    for x in timers:
        x.comm_seconds = 0.0
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for b in batches[2:]:
        step(b)
    total = time.perf_counter() - t0
    return {"step_s": total / steps, "comm_frac": sum(x.comm_seconds for x in timers) / total}


def all_to_all_share(cfg: RunConfig, steps: int) -> dict:
    """2 gloo workers, ``parallel.expert=2``, fp32, each worker one micro-batch per step (CPU)."""
    from pretrain.config import to_dict
    from pretrain.train.spawn import run_distributed

    d = to_dict(cfg)
    d["parallel"]["expert"] = 2
    d["cluster"]["num_workers"] = 2
    d["zero"]["stage"] = 1
    d["train"]["global_batch_size"] = 2 * cfg.train.micro_batch_size
    d["data"]["num_streams"] = 2
    d["train"]["val_sequences"] = 2
    ranks = run_distributed(_ep_worker, 2, d, steps)
    return {
        "moe_ep2_step_s": sum(r["step_s"] for r in ranks) / 2,
        "moe_all_to_all_frac": sum(r["comm_frac"] for r in ranks) / 2,
    }
