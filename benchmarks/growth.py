"""Does growth pay? (``./launch.sh bench --growth``): a target decoder trained from scratch against growth recipes
that end at the same training FLOPs, for several seeds, on held-out text; each a real run, all MLflow children of
one parent run.

Every run gets the same budget, ``train.max_flops`` (the target's FLOPs for ``--tokens`` tokens): the product
derives each run's steps, counting the small model's FLOPs before a growth at its size, so ``scratch`` and a grown
run end at the same FLOPs with their cosine schedules fully decayed. Growth points are ``at_fraction`` of that
budget. Validation every 1/25 of the budget (``train.val_every_flops``) gives every run the same FLOPs grid.

``growth_flops_saving`` of a recipe is 1 - (FLOPs at which it first reaches the scratch run's final validation loss)
/ (scratch FLOPs), per seed (:func:`benchmarks.study.flops_saving`); the table's value is the minimum over seeds.
When the best recipe saves less than 25 %, or with ``--sizes``, the study also runs scratch, the best recipe and its
small model alone at two smaller targets: the saving against the target's size, and the share of the budget after
which the target trained from scratch is ahead of the small model (before it, the small model is the better use of
FLOPs: the window in which growing can pay).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.study import ROOT, Study, corpus_overrides, first_below, flops_saving

TARGET = {"num_layers": 8, "hidden_size": 256, "num_heads": 8, "num_kv_heads": 4}
"""The default target decoder (head size 32, so half the width keeps whole heads and key-value groups);
``model.<key>=N`` overrides of these keys change it."""


def sizes_of(target: dict) -> list[dict]:
    """The trend's target sizes, smallest first: half and three quarters of ``target`` in depth, width and heads
    (key-value heads halved), then ``target``."""
    L, D, H, KV = (target[k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads"))
    half = {"num_layers": L // 2, "hidden_size": D // 2, "num_heads": H // 2, "num_kv_heads": max(1, KV // 2)}
    three_quarters = {"num_layers": 3 * L // 4, "hidden_size": 3 * D // 4, "num_heads": 3 * H // 4}
    return [half, {**three_quarters, "num_kv_heads": max(1, KV // 2)}, target]


def _model(arch: dict) -> list[str]:
    return [f"model.{k}={v}" for k, v in arch.items()]


def recipes(arch: dict) -> dict[str, list[str]]:
    """Recipe name -> overrides on the target ``arch``: the small model and one ``growth.schedule`` entry."""
    depth, width = arch["num_layers"], arch["hidden_size"]

    def stack(factor: int, at: float, *extra: str) -> list[str]:
        return [
            f"model.num_layers={depth // factor}",
            f"growth.schedule=[{{at_fraction: {at}, depth: {depth}, depth_op: stack}}]",  # the total: 6 // 4 * 4 != 6
            *extra,
        ]

    half = [f"model.hidden_size={width // 2}", f"model.num_heads={arch['num_heads'] // 2}"]
    half.append(f"model.num_kv_heads={max(1, arch['num_kv_heads'] // 2)}")
    return {
        "stack2@5%": stack(2, 0.05),
        "stack2@10%": stack(2, 0.1),
        "stack2@20%": stack(2, 0.2),
        "stack4@10%": stack(4, 0.1),
        "tile2@10%": [*half, "growth.schedule=[{at_fraction: 0.1, width: 2x, width_op: tile}]"],
        "stack2@10%:grown-moments": stack(2, 0.1, "growth.optimizer=grow"),
        # not in the default study (--recipes NAME,...):
        "stack4@5%": stack(4, 0.05),
        "stack2@10%:no-rewarm": stack(2, 0.1, "growth.rewarm_steps=0"),
        "stack2@10%:identity": [
            f"model.num_layers={depth // 2}",
            f"growth.schedule=[{{at_fraction: 0.1, depth: {depth}, depth_op: identity}}]",
        ],
    }


DEFAULT_RECIPES = 6
"""The first recipes of :func:`recipes` run by default."""


def _small_alone(extra: list[str]) -> list[str]:
    """A recipe's small model trained on the whole budget, without its growth."""
    return [o for o in extra if not o.startswith("growth.")]


def _budget(study: Study, arch: dict, tokens: int) -> tuple[float, float]:
    """(FLOPs of ``tokens`` for the target ``arch``, its block FLOPs share)."""
    from pretrain.config import make_plan
    from pretrain.model import flops_per_token
    from pretrain.model.growth_stages import block_flops_share

    cfg = study.config(_model(arch))
    plan = make_plan(cfg, cfg.cluster.num_workers)
    per_token = flops_per_token(cfg.model, plan.seq_len, cfg.moe)
    return tokens * per_token, block_flops_share(cfg.model, plan.seq_len, cfg.moe)


def _budget_overrides(flops: float, points: int) -> list[str]:
    return [f"train.max_flops={flops:.6g}", "train.val_every=0", f"train.val_every_flops={flops / points:.6g}"]


def growth_bench(
    overrides: list[str],
    *,
    tokens: int = 500_000,
    seeds: tuple[int, ...] = (0, 1),
    only: list[str] | None = None,
    sizes: bool | None = None,
    points: int = 25,
    root: Path | None = None,
) -> dict:
    """The study; ``only`` limits the recipes, ``sizes`` forces (True) or skips (False) the trend (None: when the
    best recipe saves < 25 %). Returns the study's dict (see :func:`summary`)."""
    corpus, corpus_name = corpus_overrides()
    base = [
        "cluster.use_ray=false",
        "cluster.num_workers=1",
        "checkpoint.every_steps=0",
        "stability.plot_at_end=false",
        "train.log_every=50",
        "train.warmup_steps=20",
        "growth.rewarm_steps=20",
        "data.val_holdout=0.03",
        "train.val_sequences=64",
        "model.vocab_size=4096",
        "data.tokenizer_vocab_size=4096",
        *corpus,
        *overrides,
    ]
    target = {**TARGET, **{k.split(".")[1]: int(v) for k, v in _split(overrides) if k.split(".")[1] in TARGET}}
    base = [o for o in base if o.split("=")[0].removeprefix("model.") not in TARGET]
    study = Study("bench-growth", ROOT / "configs" / "demo-decoder.yaml", base, root)
    flops, share = _budget(study, target, tokens)
    known = list(recipes(target))
    names = known[:DEFAULT_RECIPES] if only is None else [n for n in known if n in only]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise SystemExit(
            f"bench --growth --recipes: unknown {', '.join(unknown)} (known: {', '.join(recipes(target))})"
        )
    out: dict = {
        "target": target,
        "block_flops_share": share,
        "budget_flops": flops,
        "budget_tokens": tokens,
        "corpus": corpus_name,
        "seeds": list(seeds),
        "recipes": {n: recipes(target)[n] for n in names},
        "curves": {},
        "run_ids": {},
    }
    for seed in seeds:
        for name in ["scratch", *names]:
            extra = [*_model(target), *recipes(target).get(name, []), f"train.seed={seed}"]
            run = study.train(f"{name} seed {seed}", [*extra, *_budget_overrides(flops, points)])
            out["curves"].setdefault(name, {})[seed] = run.flops
            out["run_ids"].setdefault(name, {})[seed] = run.run_id
    savings = {n: {s: flops_saving(out["curves"]["scratch"][s], out["curves"][n][s]) for s in seeds} for n in names}
    out["growth_flops_saving_per_seed"] = savings
    out["growth_flops_saving"] = {n: _min_saving(v.values()) for n, v in savings.items()}
    ranked = sorted(
        names, key=lambda n: -1e9 if out["growth_flops_saving"][n] is None else out["growth_flops_saving"][n]
    )
    out["best_recipe"] = ranked[-1] if ranked else None
    best = out["best_recipe"]
    if best and (sizes or (sizes is None and (out["growth_flops_saving"][best] or -1) < 0.25)):
        out["trend"] = _trend(study, out, best, tokens, seeds[0], points)
    figure = _plot(out, study.work / "growth_vs_scratch.png")
    out["plot"] = str(figure)
    out["mlflow"] = {"tracking_uri": study.uri, "parent_run": study.parent}
    study.finish(summary(out), figure)
    return out


def _split(overrides: list[str]) -> list[tuple[str, str]]:
    return [tuple(o.split("=", 1)) for o in overrides if o.startswith("model.") and "=" in o]  # type: ignore[misc]


def _min_saving(values) -> float | None:
    """The minimum over seeds (a seed that never reaches the scratch loss makes it None)."""
    values = list(values)
    return None if any(v is None for v in values) else min(values)


def _trend(study: Study, out: dict, best: str, tokens: int, seed: int, points: int) -> list[dict]:
    """Per target size: scratch, the best recipe and its small model alone (one seed; the target's scratch and best
    runs are the study's)."""
    rows = []
    for arch in sizes_of(out["target"]):
        flops, share = _budget(study, arch, tokens)
        budget = [f"train.seed={seed}", *_budget_overrides(flops, points)]
        recipe = recipes(arch)[best]
        if arch == out["target"]:
            scratch, grown = out["curves"]["scratch"][seed], out["curves"][best][seed]
        else:
            scratch = study.train(
                f"trend {arch['num_layers']}x{arch['hidden_size']} scratch", [*_model(arch), *budget]
            ).flops
            grown = study.train(
                f"trend {arch['num_layers']}x{arch['hidden_size']} {best}", [*_model(arch), *recipe, *budget]
            ).flops
        small = study.train(
            f"trend {arch['num_layers']}x{arch['hidden_size']} small alone",
            [*_model(arch), *_small_alone(recipe), *budget],
        ).flops
        ahead = first_below(scratch, small)
        rows.append(
            {
                "target": arch,
                "block_flops_share": share,
                "budget_flops": flops,
                "growth_flops_saving": flops_saving(scratch, grown),
                "small_alone_flops_saving": flops_saving(scratch, small),
                "scratch_ahead_of_small_from": None if ahead is None else ahead / scratch[-1][0],
                "curves": {"scratch": scratch, best: grown, "small alone": small},
            }
        )
    return rows


def _plot(out: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trend = out.get("trend")
    fig, axes = plt.subplots(1, 2 if trend else 1, figsize=(13 if trend else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    seed = out["seeds"][0]
    for name, per_seed in out["curves"].items():
        curve = per_seed[seed]
        ax.plot([f / 1e12 for f, _ in curve], [v for _, v in curve], marker=".", ms=3, label=name)
    ax.axhline(out["curves"]["scratch"][seed][-1][1], color="gray", lw=0.8, ls="--")
    ax.set_xlabel("training FLOPs (1e12)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"growth vs scratch at equal FLOPs (seed {seed})")
    ax.legend(fontsize=7)
    if trend:
        ax = axes[0][1]
        for row in trend:
            arch = row["target"]
            for name, curve in row["curves"].items():
                style = {"scratch": "-", "small alone": ":"}.get(name, "--")
                ax.plot(
                    [f / row["budget_flops"] for f, _ in curve],
                    [v for _, v in curve],
                    style,
                    label=f"{arch['num_layers']}x{arch['hidden_size']} {name}",
                )
        ax.set_xlabel("share of the budget")
        ax.set_ylabel("validation loss")
        ax.set_title("three target sizes")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(out: dict) -> dict:
    """The study's keys, with the curves as (FLOPs, loss) pairs to 6 significant digits."""

    def rounded(curve):
        return [(float(f"{f:.6g}"), float(f"{v:.6g}")) for f, v in curve]

    res = {k: v for k, v in out.items() if k not in ("curves", "trend")}
    res["curves_flops_val_loss"] = {n: {s: rounded(c) for s, c in per.items()} for n, per in out["curves"].items()}
    if "trend" in out:
        res["trend"] = [
            {
                **{k: v for k, v in row.items() if k != "curves"},
                "curves": {n: rounded(c) for n, c in row["curves"].items()},
            }
            for row in out["trend"]
        ]
    return res
