"""Layer dropout, for what it is used for (``./launch.sh bench --layer-drop --quality``): the growth study's target
decoder (:data:`benchmarks.growth.TARGET`) trained per seed on the studies' corpus, in the growth study's regime
(``--tokens``, default :data:`benchmarks.growth.TOKENS_PER_PARAM` tokens per parameter), as MLflow children of one
parent run (:mod:`benchmarks.study`).

- ``no-drop``: the budget (``train.max_flops``), cosine schedule decayed at the end: the growth study's ``scratch``
  run on the same budget, the same config (``--reuse`` reads it from a growth study's store instead of training it).
- ``half-depth, equal FLOPs``: half the blocks from scratch on the same budget (the growth study's ``stack2``
  recipe's small model alone). ``depth_pays`` (per seed) is true when the no-drop model ends below it: the regime
  in which dropping or pruning blocks has something to lose.
- ``pld``: progressive layer dropping (Zhang and He 2020, arXiv:2010.13369) in ``layer`` mode (a skipped block does
  no work): keep probability (1 - theta_bar) exp(-gamma t) + theta_bar, theta_bar = 1 - ``--pld-rate`` at the
  deepest block and less below it (``by_depth: linear``, PLD's depth rule), with gamma = ``--pld-gamma-t`` / steps
  (the paper's gamma scaled to this run's length). It trains for as many steps as the FLOPs the no-drop run executes
  allow (a dropped block's FLOPs are not executed), so both runs execute the same FLOPs.
  ``pld_time_to_loss_speedup`` = the no-drop run's training seconds to its final validation loss / PLD's training
  seconds to reach that loss (``val/train_s``, validation and checkpoints left out; None: never reached, or the two
  runs trained with other thread counts, ``threads_per_worker``: a baseline reused from a study that trained several
  runs at once had fewer cores than PLD trained here).
- ``layer-drop``: constant rate ``--prune-rate`` on every block (LayerDrop, Fan et al. 2019, arXiv:1909.11556),
  as many steps as no-drop; then ``prune layers=every_other scale=train`` (the kept blocks as they ran in training) and
  ``eval`` (the user's commands), against a half-depth model trained from scratch on the FLOPs the layer-drop run
  executed: ``pruned_vs_scratch_half_depth_gap`` (nats; > 0: the pruned model is worse); the same with
  ``scale=inference`` (the default of ``prune``), and for the no-drop model pruned (the contrast).

Every number is a minimum or maximum over seeds where the goal needs it to hold on every seed (see :func:`study`).
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.curves import time_to_loss_speedup
from benchmarks.growth import TARGET, TOKENS_PER_PARAM, VAL_SEQUENCES, VOCAB, model_overrides
from benchmarks.study import (
    ROOT,
    VAL_POINTS,
    Study,
    budget_flops,
    budget_overrides,
    corpus_overrides,
    epochs,
    model_parameters,
    seconds_comparable,
    study_base,
    vocab_of,
)

if TYPE_CHECKING:
    from pretrain.config import LayerDropConfig


def executed_share(ld: LayerDropConfig, blocks: int, steps: int, share: float) -> float:
    """Mean share of the nominal FLOPs per step that layer dropout ``ld`` leaves executed over ``steps`` steps
    (blocks carry ``share`` of the FLOPs; a dropped block executes none in ``layer`` mode; in ``sample`` mode, and
    without dropout, every block runs)."""
    from pretrain.model.layerdrop import base_rate

    if ld.rate == 0 or ld.mode != "layer":
        return 1.0
    depth = (blocks + 1) / (2 * blocks) if ld.by_depth == "linear" else 1.0  # mean of (l + 1) / L
    dropped = sum(base_rate(ld, t) for t in range(steps)) / steps * depth
    return 1.0 - share * dropped


def _dropout(rate: float, schedule: str, gamma: float, by_depth: str) -> LayerDropConfig:
    """This study's layer dropout (``layer`` mode: a dropped block does no work)."""
    from pretrain.config import LayerDropConfig

    kw: dict[str, Any] = dict(rate=rate, schedule=schedule, gamma=gamma, by_depth=by_depth, mode="layer")
    return LayerDropConfig(**kw)


def _pld_steps(steps: int, rate: float, gamma_t: float, blocks: int, share: float) -> int:
    """PLD steps that execute the FLOPs of ``steps`` no-drop steps (gamma = gamma_t / PLD steps)."""
    n = steps
    for _ in range(20):  # a fixed point: the schedule's length sets gamma
        n_next = math.ceil(
            steps / executed_share(_dropout(rate, "progressive", gamma_t / n, "linear"), blocks, n, share)
        )
        if n_next == n:
            break
        n = n_next
    return n


def _prune_and_eval(study: Study, source: str, sequences: int, scale: str = "train") -> float:
    """``prune source layers=every_other scale=...`` into the study's directory (a reused run's too), then ``eval``
    of the pruned run: its validation loss."""
    from eval.evaluate import evaluate
    from pretrain.driver.prune import prune

    with study.inside():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            prune([source, "layers=every_other", f"scale={scale}"], str(study.work / "checkpoints"))
        child = re.search(r"\[prune\] new run (\S+):", out.getvalue())
        if child is None:
            raise RuntimeError(f"prune {source}: no new run in its output:\n{out.getvalue()}")
        return float(evaluate(child.group(1), sequences=sequences, sample=False)["loss"])


def _eval(study: Study, source: str, sequences: int) -> float:
    from eval.evaluate import evaluate

    with study.inside():
        return float(evaluate(source, sequences=sequences, sample=False)["loss"])


def study(
    overrides: list[str],
    *,
    tokens: int | None = None,
    seeds: tuple[int, ...] = (0, 1),
    pld_rate: float = 0.5,
    pld_gamma_t: float = 20.0,
    prune_rate: float = 0.5,
    eval_sequences: int = VAL_SEQUENCES,
    root: Path | None = None,
    reuse: tuple[Path, ...] = (),
) -> dict:
    """The study; ``tokens`` None: :data:`TOKENS_PER_PARAM` per parameter of the model; ``reuse``: earlier studies'
    stores whose matching runs are read instead of trained (:mod:`benchmarks.reuse`). Returns its dict (every
    per-seed value, and the minimum or maximum the goals read)."""
    from pretrain.config import make_plan
    from pretrain.model.growth_stages import block_flops_share

    vocab = vocab_of(overrides, VOCAB)
    corpus, corpus_name, manifest = corpus_overrides(overrides, vocab)
    base = study_base(vocab, corpus, overrides, *model_overrides(TARGET), val_sequences=VAL_SEQUENCES)
    st = Study("bench-layer-drop-quality", ROOT / "configs" / "demo-decoder.yaml", base, root, reuse)
    cfg = st.config([])
    params = model_parameters(st, [])
    tokens = tokens or int(round(TOKENS_PER_PARAM * params, -3))
    blocks, plan = cfg.model.num_layers, make_plan(cfg, 1)
    budget = budget_overrides(budget_flops(cfg, tokens), VAL_POINTS)
    steps = st.steps(budget)
    share = block_flops_share(cfg.model, plan.seq_len, cfg.moe)
    pld_steps = _pld_steps(steps, pld_rate, pld_gamma_t, blocks, share)
    gamma = pld_gamma_t / pld_steps
    ld_share = executed_share(_dropout(prune_rate, "constant", 1.0, "uniform"), blocks, steps, share)
    half = [f"model.num_layers={blocks // 2}"]
    half_share = block_flops_share(st.config(half).model, plan.seq_len, cfg.moe)
    # half the blocks: per step (1 - share) + share / 2 of the full model's FLOPs (same head, half the blocks)
    half_step_cost = 1 - share + share / 2
    half_steps = round(steps * ld_share / half_step_cost)
    half_equal_steps = st.steps([*half, *budget])
    most = max(pld_steps, half_equal_steps) * plan.tokens_per_step  # the runs that read the most tokens
    passes = epochs(most, manifest, f"bench --layer-drop --quality: the budget ({tokens:,} tokens)")
    repeat = ["data.repeat=true"] if passes is not None and passes > 1 else []
    every = [f"train.val_every={max(1, steps // VAL_POINTS)}"]
    pld = [
        f"layer_drop.rate={pld_rate}",
        "layer_drop.schedule=progressive",
        f"layer_drop.gamma={gamma:.6g}",
        "layer_drop.by_depth=linear",
        "layer_drop.mode=layer",
    ]
    out: dict = {
        "model": {k: getattr(cfg.model, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads")},
        "parameters": params,
        "budget_tokens": steps * plan.tokens_per_step,
        "tokens_per_param": steps * plan.tokens_per_step / params,
        "corpus": corpus_name,
        "corpus_epochs_max": passes,
        "seeds": list(seeds),
        "block_flops_share": share,
        "steps": {
            "no-drop": steps,
            "pld": pld_steps,
            "layer-drop": steps,
            "half-depth": half_steps,
            "half-depth, equal FLOPs": half_equal_steps,
        },
        "pld": {"rate": pld_rate, "gamma": gamma, "gamma_x_steps": pld_gamma_t, "by_depth": "linear"},
        "executed_flops_share": {
            "pld": steps / pld_steps,
            "layer-drop": ld_share,
            "half-depth_block_share": half_share,
        },
        "per_seed": {},
    }
    for seed in seeds:
        s = [f"train.seed={seed}", *repeat]
        nodrop = st.train(f"no-drop seed {seed}", [*s, *budget], checkpoint=True)
        equal = st.train(f"half-depth equal FLOPs seed {seed}", [*s, *half, *budget])
        prog = st.train(f"pld seed {seed}", [*s, *every, f"train.max_steps={pld_steps}", *pld])
        ld_run = [*s, *every, f"train.max_steps={steps}", f"layer_drop.rate={prune_rate}"]
        ld = st.train(f"layer-drop {prune_rate:g} seed {seed}", ld_run, checkpoint=True)
        scratch = st.train(f"half-depth seed {seed}", [*s, *every, *half, f"train.max_steps={half_steps}"], True)
        half_loss = _eval(st, scratch.source, eval_sequences)
        pruned = {
            "no-drop": _prune_and_eval(st, nodrop.source, eval_sequences),
            "layer-drop": _prune_and_eval(st, ld.source, eval_sequences),
            "layer-drop, scale=inference": _prune_and_eval(st, ld.source, eval_sequences, "inference"),
        }
        row: dict[str, Any] = {
            # seconds compare only between runs of equal threads (a reused baseline may have had fewer cores)
            "pld_time_to_loss_speedup": time_to_loss_speedup(nodrop.seconds, prog.seconds)
            if seconds_comparable(nodrop, prog)
            else None,
            "threads_per_worker": {"no-drop": nodrop.threads, "pld": prog.threads},
            "final_val_loss": {
                "no-drop": nodrop.final_loss,
                "half-depth, equal FLOPs": equal.final_loss,
                "pld": prog.final_loss,
                "layer-drop": ld.final_loss,
            },
            "depth_pays": nodrop.final_loss < equal.final_loss,
            "train_seconds": {
                "no-drop": nodrop.seconds[-1][0],
                "pld": prog.seconds[-1][0],
                "layer-drop": ld.seconds[-1][0],
            },
            "half_depth_scratch_loss": half_loss,
            "full_loss": {
                "no-drop": _eval(st, nodrop.source, eval_sequences),
                "layer-drop": _eval(st, ld.source, eval_sequences),
            },
            "pruned_loss": pruned,
            "pruned_vs_scratch_half_depth_gap": pruned["layer-drop"] - half_loss,
            "no_drop_pruned_vs_scratch_half_depth_gap": pruned["no-drop"] - half_loss,
            "inference_scale_pruned_vs_scratch_half_depth_gap": pruned["layer-drop, scale=inference"] - half_loss,
            "curves_seconds": {"no-drop": nodrop.seconds, "pld": prog.seconds},
            "curves_flops": {"no-drop": nodrop.flops, "half-depth, equal FLOPs": equal.flops},
            "run_ids": {
                "no-drop": nodrop.run_id,
                "half-depth, equal FLOPs": equal.run_id,
                "pld": prog.run_id,
                "layer-drop": ld.run_id,
                "half-depth": scratch.run_id,
            },
        }
        out["per_seed"][seed] = row
    rows = list(out["per_seed"].values())
    speedups = [r["pld_time_to_loss_speedup"] for r in rows]
    out["pld_time_to_loss_speedup"] = None if None in speedups else min(speedups)
    out["pruned_vs_scratch_half_depth_gap"] = max(r["pruned_vs_scratch_half_depth_gap"] for r in rows)
    for key in ("no_drop_pruned_vs_scratch_half_depth_gap", "inference_scale_pruned_vs_scratch_half_depth_gap"):
        out[key] = max(r[key] for r in rows)
    out["depth_pays"] = all(r["depth_pays"] for r in rows)
    out["goals"] = {
        "depth_pays on every seed (the regime)": out["depth_pays"],
        "pld_time_to_loss_speedup >= 1.15 on every seed": out["pld_time_to_loss_speedup"] is not None
        and out["pld_time_to_loss_speedup"] >= 1.15,
        "pruned_vs_scratch_half_depth_gap <= 0.05 on every seed": out["pruned_vs_scratch_half_depth_gap"] <= 0.05,
    }
    figure = _plot(out, st.work / "layer_drop_quality.png")
    out["plot"] = str(figure)
    out["mlflow"] = {"tracking_uri": st.uri, "parent_run": st.parent}
    out["reused_runs"] = st.reused
    st.finish(out, figure)
    return out


def _plot(out: dict, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for seed, row in out["per_seed"].items():
        for name, curve in row["curves_seconds"].items():
            ax.plot(
                [x for x, _ in curve],
                [v for _, v in curve],
                "-" if name == "pld" else "--",
                marker=".",
                ms=3,
                label=f"{name} seed {seed}",
            )
    ax.set_xlabel("training seconds (validation and checkpoints left out)")
    ax.set_ylabel("validation loss")
    ax.set_title("progressive layer dropping against no dropout, same executed FLOPs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
