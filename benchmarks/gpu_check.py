"""One GPU check (``./launch.sh bench --gpu [--json] [--tiny]``): what a first run on a new GPU must show, each item
as pass / fail / n/a with its figure, from real commands a user runs (``python -m pretrain train``, ``resume``,
``train --dry-run``, ``export``; in process, one worker, ``cluster.use_ray=false``), each in a temporary MLflow
store and checkpoint root (:class:`benchmarks.checkpoint.Session`), offline: the built-in demo corpus and a
tokenizer trained on it once and cached.

==================  =================================================================================================
item                what passes
==================  =================================================================================================
``train``           bf16 training of ``configs/gpt-125m.yaml`` (ZeRO-1) runs; figure: tokens/s of the loop (its
                    warm-up left out) and the step time
``mfu``             model FLOPs/s over the device's peak (the run's own ``mfu_peak_tflops_per_worker``) >= 45 % on an
                    H100 / H200; n/a elsewhere (the figure is still given)
``sdpa_kernel``     the attention kernel the model's ``F.scaled_dot_product_attention`` dispatches to, seen by the
                    profiler on one forward + backward of the same model, dtype and micro-batch: a fused kernel
                    (flash, efficient, cuDNN) on CUDA; n/a on CPU
``memory_plan``     ``train --dry-run``'s memory per GPU within 10 % of the run's ``torch.cuda.max_memory_allocated``
                    (``sys/max_allocated_gb``, the largest over the run); n/a on CPU (no allocator peak)
``checkpoint``      a run saving asynchronously (``checkpoint.async=true``) and stopped at step K, resumed for 10 more
                    steps: its losses within 1e-3 relative of the uninterrupted run's at each of those steps
``zero3``           one step under ZeRO-3 with a finite loss
``moe``             ``configs/demo-moe.yaml`` (``parallel.expert=1``) trains with finite losses
``growth``          a ``growth.schedule`` depth growth in the job (identity, no noise: the held-back loss unchanged)
``export``          ``export RUN --device cuda``: the Hugging Face export of the trained model, its logits parity check
                    run on the GPU
``wall_time``       the whole check within 8 minutes (GPU); n/a at the tiny size
==================  =================================================================================================

Only the timed run (``train``, and the dry run of ``memory_plan``) compiles its blocks (``train.compile``'s CUDA
default); the other runs check a feature and run with ``train.compile=no``. With ``--results DIR`` the items so far
are also in ``DIR/gpu-check-items.json`` after each one.

Without a CUDA device (or with ``--tiny``) every item runs at a tiny size: 2-layer models, fp32, a few steps, so the
plumbing is tested on CPU. ``--json`` prints one object: ``device``, ``tiny``, ``items`` (name -> status, figure
and the numbers) and ``passed`` (no item failed).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoint import Session
from benchmarks.gpu_results import results_markdown, results_name, table, write_new
from pretrain.config import ConfigError
from pretrain.config.errors import ArgumentParser

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
MFU_GOAL = 0.45
MEMORY_TOLERANCE = 0.10
LOSS_TOLERANCE = 1e-3
WALL_LIMIT_S = 480.0
RESUMED_STEPS = 10

COMMON = [
    "cluster.num_workers=1",
    "cluster.use_ray=false",
    "data.sources=[{path: demo}]",
    "data.num_streams=1",
    "data.val_holdout=0.02",
    "train.decay=constant",
    "train.val_every=0",
    "train.val_sequences=8",
    "stability.plot_at_end=false",
]
"""Every run: one worker in this process, the built-in demo corpus (offline), a constant LR after the warm-up (the
interrupted and the uninterrupted run have one schedule whatever their lengths), one small validation at the end."""

GPU = [
    "cluster.use_gpu=yes",
    "train.precision=bf16",
    "data.tokenizer_vocab_size=8192",
    "data.tokenizer_train_docs=20000",
]
GPU_125M = ["model.vocab_size=50304", "train.global_batch_size=16", "train.micro_batch_size=16"]
"""gpt-125m on one GPU: GPT-2's padded vocabulary (the model's size and FLOPs do not depend on the tokenizer the
demo corpus can train), one micro-batch of 16 x 1024 tokens per step."""

TINY = [
    "cluster.use_gpu=no",
    "train.precision=fp32",
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=2000",
    "model.vocab_size=512",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.max_seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
]
TINY_MOE = ["moe.ffn_size=64", "model.ffn_size=128", "model.num_kv_heads=2"]
NOT_COMPILED = ("train.compile=no",)


def item(status: str, figure: str, **numbers: Any) -> dict:
    return {"status": status, "figure": figure, **numbers}


def failed(e: BaseException) -> dict:
    """A failed item: the command's error, its last lines."""
    text = str(e).strip().splitlines()
    return item("fail", " | ".join(text[-6:])[-1500:] or type(e).__name__)


def metric(session: Session, run_id: str, key: str) -> dict[int, float]:
    """step -> value of one MLflow metric of a run of ``session``'s store (the last logged value per step)."""
    from mlflow import MlflowClient

    client = MlflowClient(session.env["MLFLOW_TRACKING_URI"])
    return {m.step: m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp)}


def param(session: Session, run_id: str, key: str) -> str | None:
    from mlflow import MlflowClient

    return MlflowClient(session.env["MLFLOW_TRACKING_URI"]).get_run(run_id).data.params.get(key)


def command(session: Session, *args: str) -> str:
    """``python -m pretrain ARGS`` in ``session``'s store; its output (RuntimeError with its tail when it fails)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", *args],
        env=session.env,
        capture_output=True,
        text=True,
        timeout=session.timeout,
    )
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(args)}` exited {proc.returncode}:\n" + (proc.stdout + proc.stderr)[-3000:])
    return proc.stdout + proc.stderr


def finite_losses(session: Session, summary: dict) -> dict[int, float]:
    losses = metric(session, summary["run_id"], "train/loss")
    if not losses or not all(math.isfinite(v) for v in losses.values()):
        raise RuntimeError(f"train/loss not finite or not logged: {losses}")
    return losses


def sdpa_kernel(cfg, device: torch.device) -> dict:
    """The ``aten::_scaled_dot_product_*`` op (and on CUDA the attention kernels) one forward + backward of ``cfg``'s
    model at its dtype and micro-batch dispatches to."""
    from torch.profiler import ProfilerActivity, profile

    from pretrain.model.transformer import build_model

    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    model = build_model(cfg.model, 0, cfg.moe).to(device=device, dtype=dtype).train()
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.max_seq_len), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        model(ids).logits.float().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = {e.name for e in prof.events()}
    device_names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    del model, ids, prof
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ops = sorted(n.removeprefix("aten::") for n in names if n.startswith("aten::_scaled_dot_product_"))
    kernels = sorted(n for n in device_names if re.search(r"flash|fmha|attention|attn", n, re.I))[:4]
    kind = {
        "flash_attention_for_cpu": "flash (CPU)",
        "flash_attention": "flash",
        "efficient_attention": "efficient",
        "cudnn_attention": "cudnn",
        "attention_math": "math",
    }
    ran = [v for k, v in kind.items() if any(op.startswith(f"_scaled_dot_product_{k}") for op in ops)]
    name = ran[0] if ran else "none seen"
    enabled = (
        {
            b: getattr(torch.backends.cuda, f"{b}_sdp_enabled")()
            for b in ("flash", "mem_efficient", "math", "cudnn")
            if hasattr(torch.backends.cuda, f"{b}_sdp_enabled")
        }
        if device.type == "cuda"
        else {}
    )
    status = "n/a" if device.type != "cuda" else "pass" if name in ("flash", "efficient", "cudnn") else "fail"
    return item(status, name, ops=ops, kernels=kernels, backends_enabled=enabled)


class Check:
    """The items in order, each from its own commands; an item that fails does not stop the others (an item that
    needs another's run is reported failed with why)."""

    def __init__(self, tiny: bool, steps: int, timeout: float, work: Path, progress: Path | None = None):
        """``progress``: a JSON file rewritten after each item with the items so far (what a check cut short by its
        machine's time limit still leaves)."""
        self.tiny, self.gpu = tiny, torch.cuda.is_available() and not tiny
        self.steps, self.session = steps, Session(work, timeout)
        self.items: dict[str, dict] = {}
        self.main: dict | None = None
        self.progress = progress

    def base(self, config: str, *extra: str, compiled: bool = False) -> list[str]:
        """``config``'s run at the check's size. Only the timed run (``compiled``) keeps ``train.compile``'s
        default (on for CUDA): the others check a feature, not its speed, and each would otherwise spend its
        first steps compiling the blocks again, in a new process."""
        size = (GPU + (GPU_125M if config == "gpt-125m" else [])) if self.gpu else TINY
        return [str(CONFIGS / f"{config}.yaml"), *COMMON, *size, *(() if compiled else NOT_COMPILED), *extra]

    def run(self, name: str, fn) -> None:
        print(f"[bench] gpu check: {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # the item fails; the check goes on
            out = failed(e)
        parts = out if name == "train" and "train" in out else {name: out}  # train: also mfu and sdpa_kernel
        if name == "train" and "train" not in out:
            skipped = item("fail", "not measured: the train run failed")
            parts.update(mfu=skipped, sdpa_kernel=dict(skipped))
        parts[name]["seconds"] = round(time.perf_counter() - t0, 1)
        self.items.update(parts)
        for key, v in parts.items():
            print(f"[bench] gpu check: {key}: {v['status']} {v['figure']}", file=sys.stderr, flush=True)
        if self.progress is not None:
            part = self.progress.with_name(self.progress.name + ".part")
            part.write_text(json.dumps(self.items, indent=1, default=str))
            part.replace(self.progress)

    def timed(self) -> list[str]:
        """The timed run (``train``), as ``memory_plan``'s dry run plans it too."""
        steps = (f"train.max_steps={self.steps}", "train.warmup_steps=10", "train.log_every=10")
        return self.base("gpt-125m", *steps, compiled=True)

    def train(self) -> dict:
        over = self.timed()
        self.main = self.session.pretrain("train", *over)
        from pretrain.config import load_config
        from pretrain.model import flops_per_token

        cfg = load_config(over[0], over[1:])
        tps = float(self.main.get("loop_mean_tokens_per_s") or self.main["tokens_per_s"])
        peak = float(param(self.session, self.main["run_id"], "mfu_peak_tflops_per_worker") or "nan") * 1e12
        mfu = flops_per_token(cfg.model, cfg.model.max_seq_len, cfg.moe) * tps / peak
        finite_losses(self.session, self.main)
        step_s = cfg.train.global_batch_size * cfg.model.max_seq_len / tps
        name = torch.cuda.get_device_name() if self.gpu else "CPU"
        goal = self.gpu and any(g in name for g in ("H100", "H200"))
        train = item("pass", f"{tps:,.0f} tokens/s, {step_s * 1e3:.1f} ms/step", tokens_per_s=tps, step_s=step_s)
        mfu_item = item(
            ("pass" if mfu >= MFU_GOAL else "fail") if goal else "n/a",
            f"{mfu:.1%}" + ("" if goal else f" (the {MFU_GOAL:.0%} goal is for H100/H200; this is {name})"),
            mfu=mfu,
            peak_tflops=peak / 1e12,
        )
        try:
            kernel = sdpa_kernel(cfg, torch.device("cuda" if self.gpu else "cpu"))
        except Exception as e:  # the probe's failure is its item's, not the run's
            kernel = failed(e)
        return {"train": train, "mfu": mfu_item, "sdpa_kernel": kernel}

    def memory_plan(self) -> dict:
        if self.main is None:
            raise RuntimeError("needs the train item's run, which failed")
        over = self.timed()
        out = command(self.session, "train", *over, "--dry-run", f"checkpoint.dir={self.session.runs}")
        found = re.search(r"memory\s+([\d,.]+) GiB per (GPU|worker)", out)
        if not found:
            raise RuntimeError(f"train --dry-run printed no memory line:\n{out[-2000:]}")
        plan = float(found.group(1).replace(",", ""))
        if not self.gpu:
            return item("n/a", f"plan {plan:.3f} GiB per worker; no allocator peak on CPU", plan_gib=plan)
        peak = max(metric(self.session, self.main["run_id"], "sys/max_allocated_gb").values())
        rel = (plan - peak) / peak
        return item(
            "pass" if abs(rel) <= MEMORY_TOLERANCE else "fail",
            f"plan {plan:.2f} GiB vs max_memory_allocated {peak:.2f} GiB ({rel:+.1%})",
            plan_gib=plan,
            max_allocated_gib=peak,
            relative=rel,
        )

    def checkpoint(self) -> dict:
        k = 10
        common = self.base("gpt-125m", "train.warmup_steps=4", "train.log_every=1")
        whole = self.session.pretrain("train", *common, f"train.max_steps={k + RESUMED_STEPS}")
        cut = self.session.pretrain(
            "train", *common, f"train.max_steps={k}", "checkpoint.async=true", f"checkpoint.every_steps={k // 2}"
        )
        resumed = self.session.pretrain("resume", cut["run_id"], f"train.max_steps={k + RESUMED_STEPS}")
        want, got = finite_losses(self.session, whole), finite_losses(self.session, resumed)
        steps = range(k + 1, k + RESUMED_STEPS + 1)
        if not all(s in got for s in steps):
            raise RuntimeError(f"the resumed run logged steps {sorted(got)}, not {k + 1}..{k + RESUMED_STEPS}")
        rel = max(abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in steps)
        saves = [r for r in cut.get("checkpoint_saves", []) if r.get("step", k) < k]
        return item(
            "pass" if rel <= LOSS_TOLERANCE else "fail",
            f"max rel. loss diff {rel:.1e} over steps {k + 1}-{k + RESUMED_STEPS} after an async save at step {k}"
            + (f" (mid-run save stalled the loop {saves[0]['stall_s'] * 1e3:.0f} ms)" if saves else ""),
            max_relative_diff=rel,
            bitwise=rel == 0,
        )

    def zero3(self) -> dict:
        s = self.session.pretrain(
            "train", *self.base("gpt-125m", "zero.stage=3", "train.max_steps=1", "train.log_every=1")
        )
        loss = finite_losses(self.session, s)[1]
        return item("pass", f"step 1 loss {loss:.4f}", loss=loss)

    def moe(self) -> dict:
        extra = [] if self.gpu else TINY_MOE
        s = self.session.pretrain(
            "train", *self.base("demo-moe", "parallel.expert=1", "train.max_steps=4", "train.log_every=1", *extra)
        )
        losses = finite_losses(self.session, s)
        return item("pass", f"losses {losses[min(losses)]:.4f} -> {losses[max(losses)]:.4f}", losses=losses)

    def growth(self) -> dict:
        s = self.session.pretrain(
            "train",
            *self.base(
                "demo-decoder",
                "train.max_steps=4",
                "train.log_every=1",
                "growth.schedule=[{at_step: 2, depth: 2x, depth_op: identity, noise: 0}]",
            ),
        )
        finite_losses(self.session, s)
        before = metric(self.session, s["run_id"], "growth/loss_before").get(2)
        after = metric(self.session, s["run_id"], "growth/loss_after").get(2)
        params = metric(self.session, s["run_id"], "growth/parameters").get(2)
        if before is None or after is None or params is None:
            raise RuntimeError("no growth was logged at step 2")
        return item(
            "pass",
            f"depth 2x at step 2: held-back loss {before:.5f} -> {after:.5f}, {params:,.0f} parameters",
            loss_before=before,
            loss_after=after,
            parameters=params,
        )

    def export(self) -> dict:
        if self.main is None:
            raise RuntimeError("needs the train item's run, which failed")
        out = self.session.dir / "export"
        device = "cuda" if self.gpu else "cpu"
        command(self.session, "export", self.main["run_id"], "--out", str(out), "--device", device)
        from pretrain.export.hf import METADATA_FILE

        diff = float(json.loads((out / METADATA_FILE).read_text())["parity_max_abs_diff"])
        return item("pass", f"parity on {device}: max |logits diff| {diff:.2e}", max_abs_diff=diff, device=device)


RUNS = ("train", "memory_plan", "checkpoint", "zero3", "moe", "growth", "export")
"""The items' runs, in order (``train`` also gives ``mfu`` and ``sdpa_kernel``)."""


def gpu_check(
    tiny: bool, steps: int, timeout: float, work: Path, only: tuple[str, ...] = RUNS, progress: Path | None = None
) -> dict:
    """Run the items of ``only`` (module doc; ``memory_plan`` and ``export`` need ``train``'s run, which then runs
    too); the result as one dict. ``progress``: see :class:`Check`."""
    t0 = time.perf_counter()
    check = Check(tiny, steps, timeout, work, progress)
    wanted = set(only) | ({"train"} if {"memory_plan", "export"} & set(only) else set())
    try:
        for name in (n for n in RUNS if n in wanted):
            check.run(name, getattr(check, name))
    finally:
        check.session.close()
    wall = time.perf_counter() - t0
    items = check.items
    items["wall_time"] = item(
        ("pass" if wall <= WALL_LIMIT_S else "fail") if check.gpu else "n/a",
        f"{wall:.0f} s" + ("" if check.gpu else " (tiny size)"),
        seconds=round(wall, 1),
    )
    return {
        "device": torch.cuda.get_device_name() if check.gpu else "cpu",
        "tiny": not check.gpu,
        "torch": torch.__version__,
        "items": items,
        "passed": all(v.get("status") != "fail" for v in items.values()),
    }


def gpu_driver(proc: Path = Path("/proc/driver/nvidia/version")) -> str:
    """The NVIDIA kernel driver's version line ('' when there is none): a GPU machine, whatever torch sees."""
    try:
        return " ".join(proc.read_text().splitlines()[0].split()[:8])
    except (OSError, IndexError):
        return ""


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh bench --gpu", description="One GPU check (benchmarks/gpu_check.py).")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="tiny models, fp32, a few steps (the default where there is no NVIDIA driver)",
    )
    p.add_argument("--steps", type=int, default=0, help="steps of the timed gpt-125m run (default 200 GPU, 12 tiny)")
    p.add_argument("--dir", default=".cache/bench-gpu", help="where the runs write (removed afterwards)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command")
    p.add_argument(
        "--only",
        default=",".join(RUNS),
        help=f"run only these items, comma-separated (default: all of {','.join(RUNS)}); memory_plan and export "
        "also run train",
    )
    p.add_argument(
        "--results",
        default=None,
        metavar="DIR",
        help="also write the results file DIR/<date>-<gpu>.md (benchmarks/results/ in the checkout)",
    )
    a = p.parse_args([x for x in argv if x != "--gpu"])
    only = tuple(x for x in a.only.split(",") if x)
    if not only or set(only) - set(RUNS):
        raise ConfigError(f"bench --gpu --only: {a.only!r}: give some of {', '.join(RUNS)}")
    if not a.tiny and not torch.cuda.is_available() and gpu_driver():
        raise ConfigError(
            f"bench --gpu: this machine has an NVIDIA driver ({gpu_driver()}) but torch {torch.__version__} "
            f"({'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU build'}) cannot use its GPU: the driver "
            "may be older than that CUDA needs (nvidia-smi tells); --tiny runs the CPU size"
        )
    tiny = a.tiny or not torch.cuda.is_available()
    steps = a.steps or (12 if tiny else 200)
    with contextlib.redirect_stdout(sys.stderr):  # library chatter is no result
        progress = Path(a.results) / "gpu-check-items.json" if a.results else None
        if progress is not None:
            progress.parent.mkdir(parents=True, exist_ok=True)
        result = gpu_check(tiny, steps, a.timeout, Path(a.dir), only, progress)
    if a.results:
        out = write_new(
            Path(a.results), results_name(result), results_markdown(result, "./launch.sh bench " + " ".join(argv))
        )
        print(f"[bench] gpu check: wrote {out}", file=sys.stderr)
    print(json.dumps(result, indent=1) if a.json else table(result), flush=True)
    return 0 if result["passed"] else 1
