"""What ``train --dry-run`` prints of the memory plan (:mod:`pretrain.driver.memory_plan`): the rows of the parallel
layout, parameters and memory per worker by component, and on GPUs the verdict against ``cluster.gpu_type``'s memory
with the single changes that would make the run fit."""

from __future__ import annotations

import copy
import dataclasses
import math

from pretrain.config import RunConfig, RunPlan, make_plan
from pretrain.config.runtime import GPU_MEMORY_GIB
from pretrain.driver.memory_plan import (
    CUDA_CONTEXT,
    FIT_SHARE,
    GIB,
    REDUCE_BYTES,
    Layout,
    ParamCounts,
    activations,
    gradient_bytes,
    held_and_shard,
    layout_of,
    memory,
    optimizer_bytes,
    reduce_bucket,
)


def _batch(cfg: RunConfig, cap: int) -> dict[str, int]:
    """The plan's micro-batch and accumulation under a micro-batch cap of ``cap``."""
    c = copy.deepcopy(cfg)
    c.train.micro_batch_size = cap
    plan = make_plan(c, cfg.cluster.num_workers)
    return {"micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum}


def fixes(cfg: RunConfig, counts: ParamCounts, lay: Layout, limit: float) -> list[str]:
    """Single changes after which the total is within ``limit`` bytes, each as ``key=value (total)``; when none
    is enough alone, all of them together, or what they still need."""

    def total(**change) -> float:
        return memory(cfg, counts, dataclasses.replace(lay, **change)).total

    out: list[str] = []
    combined: dict = {}
    top = 2 if cfg.moe.enabled else 3  # MoE: not with ZeRO-3
    if lay.stage < top:
        combined["stage"] = top
        if (t := total(stage=top)) <= limit:
            out.append(f"zero.stage={top} ({t / GIB:.1f} GiB)")
    for mode in ("selective", "full"):
        if lay.recompute not in (mode, "full"):
            combined["recompute"] = mode
            if (t := total(recompute=mode)) <= limit:
                out.append(f"train.activation_checkpointing={mode} ({t / GIB:.1f} GiB)")
                break
    for cap in range(lay.micro_batch - 1, 0, -1):
        combined.update(batch := _batch(cfg, cap))
        if batch["micro_batch"] == cap and (t := total(**batch)) <= limit:  # (a cap the plan takes as it is)
            out.append(f"train.micro_batch_size={cap} ({t / GIB:.1f} GiB)")
            break
    if lay.stage > 0:
        for n in (lay.dp * 2**i for i in range(1, 11)):
            share = -(-cfg.train.global_batch_size // n)
            micro = min(lay.micro_batch, share)
            if (t := total(dp=n, micro_batch=micro, grad_accum=-(-share // micro))) <= limit:
                out.append(f"more GPUs: cluster.num_workers={n} ({t / GIB:.1f} GiB)")
                break
    if lay.stage > 0 and not lay.offload and (t := total(offload=True)) <= limit:
        out.append(f"zero.offload_optimizer=true ({t / GIB:.1f} GiB)")
    if out or not combined:
        return out
    names = {"stage": "zero.stage", "recompute": "train.activation_checkpointing", "micro_batch": "micro-batch"}
    both = " + ".join(f"{names[k]}={v}" for k, v in combined.items() if k in names)
    t = total(**combined)
    if t <= limit:
        return [f"{both} together ({t / GIB:.1f} GiB)"]
    return [f"even {both} need {t / GIB:.1f} GiB: a GPU with more memory, or more GPUs with ZeRO-3"]


def verdict(cfg: RunConfig, counts: ParamCounts, lay: Layout) -> str:
    """One line: the total against ``cluster.gpu_type``'s memory, and what to change when it does not fit."""
    gpu = cfg.cluster.gpu_type
    if not gpu:
        return f"no GPU type named (cluster.gpu_type: one of {', '.join(GPU_MEMORY_GIB)})"
    cap = GPU_MEMORY_GIB[gpu] * GIB
    t = memory(cfg, counts, lay).total
    if t + CUDA_CONTEXT <= FIT_SHARE * cap:
        return f"{gpu}: fits: {t / GIB:.1f} of {cap / GIB:g} GiB per GPU"
    what = "does not fit" if t + CUDA_CONTEXT > cap else f"tight (more than {FIT_SHARE:.0%} with the CUDA context)"
    todo = fixes(cfg, counts, lay, FIT_SHARE * cap - CUDA_CONTEXT)
    lead = "" if todo[:1] and todo[0].startswith("even ") else "to fit: "
    line = f"{gpu}: {what}: {t / GIB:.1f} of {cap / GIB:g} GiB per GPU"
    return line + (f"; {lead}{', or '.join(todo)}" if todo else "")


def plan_rows(cfg: RunConfig, plan: RunPlan, counts: ParamCounts) -> list[tuple[str, str]]:
    """The dry run's rows: the parallel layout, parameters, memory per worker by component, the verdict."""
    c, lay = cfg.cluster, layout_of(cfg, plan)
    if lay.gpus:
        nodes, per = math.ceil(c.num_workers / c.gpus_per_node), min(c.num_workers, c.gpus_per_node)
        where = f"{nodes} node(s) x {per} GPU(s) (cluster.gpus_per_node={c.gpus_per_node})"
    else:
        where = f"{c.num_workers} CPU worker(s)"
    params = f"{counts.total / 1e6:,.2f}M" + (
        f", {counts.active / 1e6:,.2f}M active per token (top-{cfg.moe.top_k} of {cfg.moe.num_experts} experts)"
        if cfg.moe.enabled
        else ""
    )
    mem, acts = memory(cfg, counts, lay), activations(cfg.model, cfg.moe, lay)
    w, over = (2 if lay.precision == "bf16" else 4), f"partitioned over {lay.zero_group}"
    bucket = reduce_bucket(cfg, lay, held_and_shard(counts, lay)[0]) * REDUCE_BYTES / GIB
    offload = f"; offloaded: {mem.host_optimizer / GIB:,.2f} GiB of host memory" if lay.offload else ""
    parts = {
        "weights": f"{w} B/param" + (f", {over}, + the gathered layers" if lay.stage == 3 else ""),
        "gradients": f"{gradient_bytes(lay.precision, lay.stage)} B/param"
        + (f", {over}" if lay.stage >= 2 else "")
        + (f", + reduce bucket {bucket:,.2f}" if bucket else ""),
        "optimizer": f"{optimizer_bytes(lay.precision, lay.stage)} B/param"
        + (f", {over}" if lay.stage else "")
        + offload,
        "activations": f"kept for the backward {acts.kept / GIB:,.2f}, + {acts.at_start / GIB:,.2f} logits and loss "
        f"at the backward's start, or + {acts.with_gradients / GIB:,.2f} once gradients exist"
        + (f"; health-probe steps + {mem.probe / GIB:,.2f}" if mem.probe else ""),
    }
    unit = "GPU" if lay.gpus else "worker (host memory)"
    less = sum(mem.parts().values()) > mem.total + 1
    rows = [
        ("parallel", f"{where}; data parallel {lay.dp}, tensor {lay.tp} x sequence {lay.sp} x expert {lay.ep}"),
        ("parameters", params),
        (
            "memory",
            f"{mem.total / GIB:,.2f} GiB per {unit} at the step's peak: {lay.precision}, ZeRO-{lay.stage}, micro-batch "
            f"{lay.micro_batch} x {lay.seq_len // lay.sp} tokens, recompute {lay.recompute}"
            + ("; less than the sum below, whose parts are not all at their largest at once" if less else "")
            + " (docs/memory-plan.md)",
        ),
        *(("", f"{k:<12} {v / GIB:8,.2f} GiB  ({parts[k]})") for k, v in mem.parts().items()),
    ]
    if lay.gpus:
        rows.append(("verdict", verdict(cfg, counts, lay)))
    return rows
