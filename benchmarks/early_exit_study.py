"""Early-exit training, for what it is used for (``./launch.sh bench --early-exit`` without ``--model``): one decoder
trained without and with the early-exit loss (LayerSkip: Elhoushi et al. 2024, arXiv:2404.16710) from the same
config and seed at equal training FLOPs, as MLflow children of one parent run (:mod:`benchmarks.study`), then the
early-exit model decoded plainly and self-speculatively on held-out prompts (:mod:`benchmarks.early_exit_decoding`).

- ``baseline``: the growth study's target (:data:`benchmarks.growth.TARGET`) on the studies' corpus
  (:mod:`benchmarks.corpus`, or the overrides' ``data.sources``) for ``tokens`` tokens (default
  :data:`benchmarks.growth.TOKENS_PER_PARAM` per parameter; the budget's FLOPs, ``train.max_flops``), cosine schedule
  decayed at the end: the regime in which the growth and layer-dropout studies measured that depth pays (the full
  depth ahead of half depth at equal FLOPs). It is the growth study's ``scratch`` run on the same budget, the same
  config: ``reuse`` (``--reuse DIR``) reads it from an earlier study's store instead of training it.
- ``early-exit``: the same plus :data:`RECIPE` (layer dropout rising with depth, exits every 2 blocks through the
  shared final norm and LM head, rotational curriculum), with the user's ``layer_drop.*`` overrides: those change
  the recipe, and only the early-exit run, so the baseline stays the growth study's run and can be reused. Equal
  FLOPs: the baseline's training FLOPs (the product's count, :func:`pretrain.model.flops_per_token`) divided by the
  early-exit run's FLOPs per step, which are the same model's FLOPs with the blocks layer dropout skips taken out
  (``layer`` mode: a skipped block executes nothing; :func:`benchmarks.layer_drop_quality.executed_share`) plus
  6 * vocabulary * width per token for every exit the step trains (the LM-head matmul, forward and backward; the
  final norm and the head's forward that activation recomputation repeats in the backward are not counted, as
  recomputation is not counted for the blocks). So the early-exit run takes fewer steps, fixed before it starts.

The two runs train side by side on a machine without a GPU (``--jobs``: each in its own process on half the CPUs,
:mod:`benchmarks.side_by_side`; ``--jobs 1``: one after the other, in this process).

Reported: both runs' full-depth final validation loss and their difference (the cost of early-exit training; goal
<= 0.02 nats), each exit's validation loss and acceptance at every validation (``val/exit_<E>/*``), the speed-up
each exit's final acceptance allows at best (``speedup_bounds``, :func:`pretrain.model.early_exit.speedup_bound`;
with acceptances independent from token to token no implementation beats it, so it tells whether a slow exit is the
decoder's cost or the model's), both final models' in-context copying (``in_context_copying``,
:mod:`benchmarks.copying`: at this size whether a run learned to copy moves its final loss by more than the
early-exit loss costs, so the loss gap is read against it), then decoding of the early-exit model on ``prompts``
held-out prompts of the corpus's validation split: plain greedy against self-speculative at every exit through
``transformers``' ``generate(assistant_early_exit=E)`` (tokens/s, identical outputs, acceptance; the best exit is the
fastest whose every output is identical; goal >= 1.5x), and the best exit through ``./launch.sh generate RUN
--early-exit E --json`` on ``cli_prompts`` prompts. A reused run's curves are read from the store that holds it, its
model from its checkpoints (so a run is reused only while they are on disk).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.growth import TARGET, TOKENS_PER_PARAM, VAL_SEQUENCES, VOCAB, model_overrides
from benchmarks.study import (
    ROOT,
    VAL_POINTS,
    RunCurves,
    Study,
    budget_flops,
    budget_overrides,
    corpus_overrides,
    epochs,
    model_parameters,
    study_base,
    vocab_of,
)

RECIPE = [
    "layer_drop.rate=0.1",
    "layer_drop.by_depth=linear",
    "layer_drop.mode=layer",
    "layer_drop.early_exit.layers=every:2",
    "layer_drop.early_exit.scale=1.0",
    "layer_drop.early_exit.curriculum=rotational",
    "layer_drop.early_exit.rotation=2",
]
"""The early-exit run's additions (the user's ``layer_drop.*`` overrides replace them, in that run only)."""

GOALS = {"speedup": 1.5, "loss_gap": 0.02}


def exit_head_flops(vocab: int, width: int) -> float:
    """Training FLOPs per token of one exit's LM-head matmul, forward and backward: 6 * vocabulary * width."""
    return 6.0 * vocab * width


def early_exit_steps(cfg, budget: float, per_token: float, tokens_per_step: int, share: float) -> tuple[int, dict]:
    """Steps of the early-exit run ``cfg`` that spend ``budget`` FLOPs (module docstring), and the arithmetic."""
    from benchmarks.layer_drop_quality import executed_share
    from pretrain.model.early_exit import active_exits

    ld, L = cfg.layer_drop, cfg.model.num_layers
    head = exit_head_flops(cfg.model.vocab_size, cfg.model.hidden_size)
    n = max(1, math.ceil(budget / (tokens_per_step * per_token)))
    for _ in range(20):  # a fixed point: the curriculum's exits per step depend on the run's length
        executed = executed_share(ld, L, n, share)  # its mode and warm-up counted (sample mode: every block runs)
        exits = sum(len(active_exits(ld.early_exit, L, t, n)) for t in range(n)) / n
        step_flops = tokens_per_step * (per_token * executed + exits * head)
        n_next = max(1, round(budget / step_flops))
        if n_next == n:
            break
        n = n_next
    return n, {
        "executed_flops_share": executed,  # of the model's FLOPs a token: the blocks skipped left out
        "exits_per_step": exits,
        "exit_head_flops_per_token": head,
        "flops_per_token": per_token * executed + exits * head,
        "flops": n * step_flops,
    }


def _history(st: Study, run: RunCurves, key: str) -> list[tuple[int, float]]:
    """(step, value) of metric ``key`` of ``run``, from the store that holds it (a reused run's is not the study's)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=run.tracking_uri) if run.tracking_uri else st.client
    return sorted((m.step, m.value) for m in client.get_metric_history(run.run_id, key))


def study(
    overrides: list[str],
    *,
    tokens: int | None = None,
    seed: int = 0,
    prompts: int = 50,
    prompt_tokens: int = 16,
    max_new_tokens: int = 32,
    draft_tokens: int | None = 4,
    draft_confidence: float | None = None,
    cli_prompts: int = 3,
    validations: int = 10,
    root: Path | None = None,
    reuse: tuple[Path, ...] = (),
    jobs: int = 1,
) -> dict[str, Any]:
    """The study (module docstring); ``validations``: the early-exit run's (each scores every exit); ``reuse``:
    earlier studies' stores whose matching runs are read instead of trained (:mod:`benchmarks.reuse`); ``jobs``:
    2 trains the two runs side by side (:meth:`benchmarks.study.Study.train_many`). Returns its dict."""
    import torch

    from benchmarks.copying import copying_probe
    from benchmarks.early_exit_decoding import decoding_benchmark, heldout_prompts, through_cli
    from eval.generator import load_generator
    from pretrain.config import ConfigError, make_plan
    from pretrain.model import flops_per_token
    from pretrain.model.early_exit import speedup_bound
    from pretrain.model.growth_stages import block_flops_share

    vocab = vocab_of(overrides, VOCAB)
    corpus, corpus_name, manifest = corpus_overrides(overrides, vocab)
    mine = [o for o in overrides if o.startswith("layer_drop.")]  # the recipe's: the early-exit run's alone
    shared = [o for o in overrides if o not in mine]
    base = study_base(vocab, corpus, shared, *model_overrides(TARGET), val_sequences=VAL_SEQUENCES)
    st = Study("bench-early-exit", ROOT / "configs" / "demo-decoder.yaml", base, root, reuse)
    given = {o.split("=", 1)[0] for o in mine}
    recipe = [*(o for o in RECIPE if o.split("=", 1)[0] not in given), *mine]
    cfg, ee_cfg = st.config([]), st.config(recipe)
    if not ee_cfg.layer_drop.early_exit.enabled:
        raise ConfigError("bench --early-exit: layer_drop.early_exit.layers is '' (the study needs exits)")
    L = cfg.model.num_layers
    plan = make_plan(cfg, 1)
    tokens_per_step = plan.seq_len * cfg.train.global_batch_size
    per_token = flops_per_token(cfg.model, plan.seq_len, cfg.moe)
    params = model_parameters(st, [])
    tokens = tokens or int(round(TOKENS_PER_PARAM * params, -3))
    baseline = budget_overrides(budget_flops(cfg, tokens), VAL_POINTS)
    steps = st.steps(baseline)
    budget = steps * tokens_per_step * per_token  # what the baseline executes
    share = block_flops_share(cfg.model, plan.seq_len, cfg.moe)
    ee_steps, arithmetic = early_exit_steps(ee_cfg, budget, per_token, tokens_per_step, share)
    passes = epochs(steps * tokens_per_step, manifest, "bench --early-exit: the budget")
    repeat = ["data.repeat=true"] if passes is not None and passes > 1 else []
    seed_o = f"train.seed={seed}"
    every = f"train.val_every={max(1, ee_steps // validations)}"
    ee_run_o = [seed_o, *repeat, f"train.max_steps={ee_steps}", every, *recipe]
    labelled = [(f"baseline seed {seed}", [seed_o, *repeat, *baseline]), (f"early-exit seed {seed}", ee_run_o)]
    runs = dict(zip(("baseline", "early-exit"), st.train_many(labelled, jobs, checkpoint=True), strict=True))
    ee_run = runs["early-exit"].source  # its run id, or for a reused run its checkpoints
    exits = {}
    for e in range(1, L):
        loss = _history(st, runs["early-exit"], f"val/exit_{e}/loss")
        if loss:
            acc = dict(_history(st, runs["early-exit"], f"val/exit_{e}/acceptance"))
            exits[str(e)] = [(s / ee_steps, v, acc.get(s)) for s, v in loss]
    final = {k: r.final_loss for k, r in runs.items()}
    out: dict[str, Any] = {
        "model": {k: getattr(cfg.model, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads")},
        "vocab_size": vocab,
        "parameters": params,
        "corpus": corpus_name,
        "corpus_epochs": passes,
        "seed": seed,
        "jobs": jobs,
        "recipe": recipe,
        "seq_len": plan.seq_len,
        "tokens_per_step": tokens_per_step,
        "budget_flops": budget,
        "steps": {"baseline": steps, "early-exit": ee_steps},
        "tokens": {"baseline": steps * tokens_per_step, "early-exit": ee_steps * tokens_per_step},
        "tokens_per_param": steps * tokens_per_step / params,
        "flops_per_token": {"baseline": per_token, "early-exit": arithmetic["flops_per_token"]},
        "early_exit_flops": arithmetic,
        "train_seconds": {k: r.seconds[-1][0] for k, r in runs.items()},
        "threads_per_worker": {k: r.threads for k, r in runs.items()},  # seconds compare at equal threads only
        "threads": torch.get_num_threads(),
        "final_val_loss": final,
        "loss_gap": final["early-exit"] - final["baseline"],
        "curves_step_share_val_loss": {
            k: [(s / r.steps, v) for s, v in _history(st, r, "val/loss")] for k, r in runs.items()
        },
        "exit_curves_step_share_loss_acceptance": exits,
        "speedup_bounds": {e: speedup_bound(c[-1][2], int(e), L) for e, c in exits.items() if c[-1][2] is not None},
        "run_ids": {k: r.run_id for k, r in runs.items()},
    }
    with st.inside():
        copying = {k: copying_probe(load_generator(r.source).model, vocab) for k, r in runs.items()}
        out["in_context_copying"] = copying
        gen = load_generator(ee_run)
        texts = heldout_prompts(gen, prompts, prompt_tokens, [])
        dec = decoding_benchmark(
            gen,
            texts,
            list(range(1, L)),
            max_new_tokens=max_new_tokens,
            draft_tokens=draft_tokens,
            draft_confidence=draft_confidence,
        )
        plain = dec.pop("_plain_texts")
        best = dec["best_exit"]
        if cli_prompts and best is not None:
            k = min(cli_prompts, len(texts))
            opts = {
                "max_new_tokens": max_new_tokens,
                "draft_tokens": draft_tokens,
                "draft_confidence": draft_confidence,
            }
            dec["cli"] = through_cli(ee_run, texts[:k], plain[:k], best, **opts)
    out["decoding"] = dec
    speed = dec["best_speedup"]
    out["goals"] = {
        f"self-speculative >= {GOALS['speedup']}x plain greedy with identical outputs": speed is not None
        and speed >= GOALS["speedup"],
        f"full-depth val loss within {GOALS['loss_gap']} nats of the baseline": out["loss_gap"] <= GOALS["loss_gap"],
    }
    figure = _plot(out, st.work / "early_exit.png")
    out["plot"] = str(figure)
    out["mlflow"] = {"tracking_uri": st.uri, "parent_run": st.parent}
    out["reused_runs"] = st.reused
    st.finish(out, figure)
    return out


def print_table(r: dict[str, Any]) -> None:
    from benchmarks.early_exit_decoding import print_table as decoding_table

    m = r["model"]
    print(f"early-exit study: {m['num_layers']} x {m['hidden_size']}, {r['parameters']:,} parameters, seed {r['seed']}")
    print(f"  budget {r['budget_flops']:.3g} FLOPs each; {r['tokens_per_param']:.2f} tokens/param (baseline)")
    for k in ("baseline", "early-exit"):
        print(
            f"  {k:<11} steps {r['steps'][k]:>6}  tokens {r['tokens'][k]:>11,}  "
            f"final val loss {r['final_val_loss'][k]:.4f}  train {r['train_seconds'][k]:.0f} s  "
            f"copies in context: 2nd copy {r['in_context_copying'][k]['gain']:.3f} nats better"
        )
    print(f"  full-depth loss gap (early-exit - baseline): {r['loss_gap']:+.4f} nats")
    for e, curve in r["exit_curves_step_share_loss_acceptance"].items():
        _, loss, acc = curve[-1]
        bound = r.get("speedup_bounds", {}).get(e)
        most = f"; at most {bound['speedup']:.2f}x at this acceptance ({bound['draft_tokens']} drafts)" if bound else ""
        print(f"  exit {e}: final val loss {loss:.4f}, acceptance {acc:.3f}{most}")
    decoding_table(r["decoding"])
    for goal, met in r["goals"].items():
        print(f"  goal {goal}: {'met' if met else 'NOT met'}")


def _plot(out: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, curve in out["curves_step_share_val_loss"].items():
        ax.plot([x for x, _ in curve], [v for _, v in curve], marker=".", label=f"{name} (full depth)")
    for e, curve in out["exit_curves_step_share_loss_acceptance"].items():
        ax.plot([x for x, _, _ in curve], [v for _, v, _ in curve], "--", label=f"early-exit, exit {e}")
        bx.plot([x for x, _, _ in curve], [a for _, _, a in curve], marker=".", label=f"exit {e}")
    ax.set_xlabel("share of the run's steps (equal FLOPs at the end)")
    ax.set_ylabel("validation loss")
    ax.legend(fontsize=7)
    bx.set_xlabel("share of the run's steps")
    bx.set_ylabel("expected acceptance (teacher-forced)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    """``./launch.sh bench --early-exit``: with ``--model``, the decoding benchmark of that model
    (:mod:`benchmarks.early_exit_decoding`); without, this study."""
    from benchmarks.early_exit_decoding import parse_args, run

    a = parse_args(argv)
    return run(a) if a.model is not None else _study(a)


def _study(a) -> int:
    """``bench --early-exit`` without ``--model``: the study, its JSON or table on stdout (all else on stderr)."""
    import contextlib
    import json
    import sys

    import torch

    from benchmarks.side_by_side import jobs_of
    from pretrain.config import ConfigError

    bad = [o for o in a.overrides if "=" not in o]
    if bad or a.data or a.exits or a.device != "cpu":
        what = f"{bad[0]!r} is not key=value" if bad else "--data, --exits and --device apply with --model"
        raise ConfigError(f"bench --early-exit (the study): {what}")
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # the runs' progress is no result
        r = study(
            a.overrides,
            tokens=a.tokens or None,
            seed=a.seed,
            prompts=a.prompts,
            prompt_tokens=a.prompt_tokens,
            max_new_tokens=a.max_new_tokens,
            draft_tokens=4 if a.draft_tokens is None else a.draft_tokens,
            draft_confidence=a.draft_confidence,
            cli_prompts=a.cli_prompts,
            root=Path(a.study_dir) if a.study_dir else None,
            reuse=tuple(Path(x) for x in a.reuse.split(",") if x),
            jobs=min(2, jobs_of(a.jobs or "auto", torch.cuda.is_available())),
        )
    with contextlib.redirect_stdout(out):
        if a.json:
            print(json.dumps(r, sort_keys=True))
        else:
            print_table(r)
    return 0
