"""Does growth pay? (``./launch.sh bench --growth``): the same final architecture trained from scratch and grown from
a smaller model, with the same total training FLOPs, on the demo corpus, measured in one run.

Variants: ``scratch`` (the final architecture for N steps); ``stack`` (half the depth for S steps, then stacked to the
full depth: shallow-to-deep stacking, T. Xiao and J. Zhu, "Introduction to Transformers: an NLP Perspective",
arXiv:2311.17633, sec. 4.2.2); ``tile`` (half the width for S steps, then tiled to the full width: Xiao and Zhu,
eq. 111, sec. 4.4). A grown variant trains ``M = N - S * F_small / F_big`` steps after growing, so its total FLOPs
(6N + attention per token, per step) equal the scratch run's. After a growth the optimizer starts fresh and the LR
re-warms over 20 steps (``growth.rewarm_steps``; without it the first AdamW steps of the fresh moments spike the
loss). Each run logs the validation loss every ``val_every`` steps; the curves are plotted against
cumulative FLOPs, and ``growth_flops_saving`` is 1 - (FLOPs at which the grown run first reaches the scratch run's
final validation loss, interpolated) / (scratch FLOPs); negative or None when it does not get there.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from pretrain.checkpoint.layout import RUN_TOKENIZER

ROOT = Path(__file__).resolve().parents[1]


def _variants(steps: int, small_steps: int, cfg) -> dict[str, list[str]]:
    m = cfg.model
    return {
        "scratch": [],
        "stack": [
            f"model.num_layers={m.num_layers // 2}",
            f"growth.schedule=[{{at_step: {small_steps}, depth: 2x, depth_op: stack}}]",
        ],
        "tile": [
            f"model.hidden_size={m.hidden_size // 2}",
            f"model.num_heads={m.num_heads // 2}",
            f"model.num_kv_heads={(m.num_kv_heads or m.num_heads) // 2}",
            f"growth.schedule=[{{at_step: {small_steps}, width: 2x, width_op: tile}}]",
        ],
    }


@contextlib.contextmanager
def _working_dir(path: Path, tracking_uri: str):
    old_cwd, old_uri = os.getcwd(), os.environ.get("MLFLOW_TRACKING_URI")
    os.chdir(path)
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    try:
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        if old_uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = old_uri


def _flops_per_step(cfg) -> float:
    from pretrain.config import make_plan
    from pretrain.model import flops_per_token

    plan = make_plan(cfg, cfg.cluster.num_workers)
    return flops_per_token(cfg.model, plan.seq_len, cfg.moe) * plan.tokens_per_step


def _crossing(curve: list[tuple[float, float]], target: float) -> float | None:
    """First FLOPs at which the (flops, loss) curve reaches ``target``, linearly interpolated."""
    prev = None
    for f, loss in curve:
        if loss <= target:
            if prev is None:
                return f
            (f0, l0) = prev
            return f0 + (f - f0) * (l0 - target) / (l0 - loss) if l0 != loss else f
        prev = (f, loss)
    return None


def growth_bench(overrides: list[str], steps: int = 300, small_frac: float = 0.4, val_every: int = 20) -> dict:
    from mlflow import MlflowClient

    from cluster.launch import run
    from pretrain.config import load_config
    from pretrain.driver.prepare import prepare_new

    base = [
        f"train.max_steps={steps}",
        f"train.val_every={val_every}",
        "train.val_sequences=32",
        "train.log_every=50",
        "checkpoint.every_steps=0",
        "cluster.use_ray=false",
        "cluster.num_workers=1",
        "stability.plot_at_end=false",
        "model.hidden_size=128",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "data.tokenizer_vocab_size=4096",
        "model.vocab_size=4096",
        "growth.rewarm_steps=20",
        *overrides,
    ]
    big = load_config(ROOT / "configs" / "demo-decoder.yaml", base)
    small_steps = int(steps * small_frac)
    results: dict = {"steps": steps, "small_steps": small_steps, "curves": {}, "total_flops": {}, "run_ids": {}}
    work = ROOT / ".cache" / "bench-growth" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)  # runs, checkpoints and the MLflow store stay there for inspection
    uri = f"sqlite:///{work}/mlflow.db"
    with _working_dir(work, uri):
        tok: list[str] = []
        f_big = _flops_per_step(big)
        for name, extra in _variants(steps, small_steps, big).items():
            cfg = load_config(ROOT / "configs" / "demo-decoder.yaml", base + tok + extra)
            f_small = _flops_per_step(cfg)
            if name != "scratch":  # same total FLOPs: fewer steps after the growth
                cfg.train.max_steps = small_steps + int(round((steps * f_big - small_steps * f_small) / f_big))
            job = prepare_new(cfg)
            tok = tok or [f"data.tokenizer={Path(job.run_dir) / RUN_TOKENIZER}"]
            print(f"[bench growth] {name}: {cfg.train.max_steps} steps", flush=True)
            run(job, cfg.cluster)
            results["run_ids"][name] = job.run_id
            hist = sorted(
                MlflowClient(tracking_uri=uri).get_metric_history(job.run_id, "val/loss"), key=lambda m: m.step
            )
            small = 0 if name == "scratch" else small_steps

            def flops_at(step: int) -> float:  # called in this iteration only
                return min(step, small) * f_small + max(step - small, 0) * f_big  # noqa: B023

            results["curves"][name] = [(flops_at(m.step), m.value) for m in hist]
            results["total_flops"][name] = flops_at(cfg.train.max_steps)
    scratch = results["curves"]["scratch"]
    target, total = scratch[-1][1], results["total_flops"]["scratch"]
    results["scratch_final_val_loss"] = target
    results["final_val_loss"] = {k: c[-1][1] for k, c in results["curves"].items()}
    results["growth_flops_saving"] = {}
    for name, curve in results["curves"].items():
        if name == "scratch":
            continue
        hit = _crossing(curve, target)
        results["growth_flops_saving"][name] = None if hit is None else 1.0 - hit / total
    results["plot"] = str(_plot(results, work / "growth_vs_scratch.png"))
    (work / "growth_vs_scratch.json").write_text(json.dumps(results, indent=1))
    client = MlflowClient(tracking_uri=uri)
    for run_id in results["run_ids"].values():  # the plot in every run's artifacts
        client.log_artifact(run_id, results["plot"], "bench")
    results["mlflow_store"] = uri
    return results


def _plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in results["curves"].items():
        ax.plot([f / 1e12 for f, _ in curve], [v for _, v in curve], marker=".", label=name)
    ax.axhline(results["scratch_final_val_loss"], color="gray", lw=0.8, ls="--")
    ax.set_xlabel("training FLOPs (1e12)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"growth vs scratch, same total FLOPs (growth at step {results['small_steps']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(results: dict) -> dict:
    """The bench keys (curves as (TFLOPs, loss) pairs, rounded)."""
    out = {k: v for k, v in results.items() if k != "curves"}
    out["curves_tflops_val_loss"] = {
        k: [(round(f / 1e12, 3), round(v, 4)) for f, v in c] for k, c in results["curves"].items()
    }
    return out
