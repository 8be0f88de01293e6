"""Does growth pay, and against what? (``./launch.sh bench --growth``): a target decoder trained from scratch, growth
recipes, and each recipe's small model trained alone, all to the same training FLOPs, for several seeds, on
held-out text; each a real run, all MLflow children of one parent run.

Every run gets the same budget, ``train.max_flops`` (the target's FLOPs for ``--tokens`` tokens; default
:data:`TOKENS_PER_PARAM` per target parameter): the product derives each run's steps, counting the small model's
FLOPs before a growth at its size, so every run ends at the same FLOPs with its cosine schedule fully decayed.
Growth points are ``at_fraction`` of that budget. Validation every 1/25 of the budget (``train.val_every_flops``),
on :data:`VAL_SEQUENCES` held-out sequences, gives every run the same FLOPs grid. The corpus is the installed
packages' sources and docs (:mod:`benchmarks.corpus`) unless the overrides name ``data.sources``; a run may read it
at most :data:`benchmarks.study.MAX_EPOCHS` times.

``growth_flops_saving`` of a recipe is 1 - (FLOPs at which it first reaches the scratch run's final validation loss)
/ (scratch FLOPs), per seed (:func:`benchmarks.curves.flops_saving`); the table's value is the minimum over seeds.
``growth_flops_saving_mean_curve`` is the same saving between the mean curves over seeds
(:func:`benchmarks.curves.mean_curve`), less sensitive to one seed's late swings.
A saving against an oversized target is no gain: the study also trains each recipe's small model alone on the whole
budget and reports, per seed, ``target_ahead_of_small`` and ``grown_vs_best_alternative`` (:func:`alternatives`),
and the iso-FLOP scan those runs make (:func:`iso_flop`); ``--scan`` runs only that scan. With ``--sizes`` the
study also runs scratch, the best recipe and its small model alone at two smaller targets (:func:`_trend`; a size
where a recipe makes no valid model, ``stack4`` of 2 blocks, is refused before anything trains, or with
``--sizes auto`` left out: ``trend_skipped``).
Every run's final model is probed for in-context copying (``in_context_copying``, :mod:`benchmarks.copying`): at
the studies' sizes whether the target from scratch learned it decides most of a recipe's saving, so a saving is
read against it; a reused run's model is read from its checkpoints (a run is reused only while they are on disk).
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.curves import ahead_from, flops_saving, mean_curve
from benchmarks.growth_check import check_grows_into_target, check_runs, check_share, checked, runnable_sizes
from benchmarks.study import (
    ROOT,
    VAL_POINTS,
    Study,
    budget_flops,
    budget_overrides,
    corpus_overrides,
    epochs,
    model_parameters,
    study_base,
    vocab_of,
)

VAL_SEQUENCES = 512
"""Held-out sequences each validation scores (about 100 files of the studies' corpus, whose validation pieces are
shuffled): the effects compared are a few hundredths of a nat."""

TARGET = {"num_layers": 4, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1}
"""The default target decoder (head size 32, so half the width keeps whole heads; 328,256 parameters at the default
vocabulary); ``model.<key>=N`` overrides of these keys change it. The smallest with 4 blocks (``stack4`` needs
them); at :data:`TOKENS_PER_PARAM` the target from scratch ends below its 2-block model alone on both seeds measured
(docs/growth.md, "Choosing the regime")."""

TOKENS_PER_PARAM = 80
"""The default budget in tokens per target parameter: the smallest measured at which the 4 x 64 target from scratch
ends below its 2-block model alone on every seed (at 20, Chinchilla's compute-optimal ratio, and at 40 it does not;
docs/growth.md, "Choosing the regime"). The layer-dropout and early-exit studies share it."""

GPU_TOKENS_PER_PARAM = 20
"""``--gpu-size``'s budget per target parameter: at 80 its 1-block model alone would read more than
:data:`benchmarks.study.MAX_EPOCHS` passes over the corpus; where its regime starts has not been measured."""

VOCAB = 2048
"""The default vocabulary of the corpus tokenizer and the model (``data.tokenizer_vocab_size=`` changes both)."""

GPU_PRESET = [
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_heads=8",
    "model.num_kv_heads=4",
    "model.max_seq_len=512",
    "train.global_batch_size=128",
    "train.micro_batch_size=128",
    "train.precision=bf16",
]
"""``bench --growth --gpu-size``: the same study at a GPU's size (4 x 256, sequences of 512, 128 a step, bf16;
3.5M parameters, 70M tokens at :data:`GPU_TOKENS_PER_PARAM`). Sized by estimate for one H100 in about 10 minutes
(docs/growth.md); not yet run."""


def sizes_of(target: dict) -> list[dict]:
    """The trend's target sizes, smallest first: half and three quarters of ``target`` in depth, width and heads
    (key-value heads halved), then ``target``."""
    L, D, H, KV = (target[k] for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads"))
    half = {"num_layers": L // 2, "hidden_size": D // 2, "num_heads": H // 2, "num_kv_heads": max(1, KV // 2)}
    three_quarters = {"num_layers": 3 * L // 4, "hidden_size": 3 * D // 4, "num_heads": 3 * H // 4}
    return [half, {**three_quarters, "num_kv_heads": max(1, KV // 2)}, target]


def model_overrides(arch: dict) -> list[str]:
    """The ``model.<key>=<value>`` overrides of ``arch`` (e.g. :data:`TARGET`)."""
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


DEFAULT_RECIPES = ("stack4@10%",)
"""The recipe run by default: the published G_stack factor (4, grown early), the growth defaults' source
(docs/growth.md); with its small model alone and the target from scratch, 3 runs a seed. ``--recipes
stack4@10%,stack2@10%`` adds half the depth stacked (and the 2-block model alone to the iso-FLOP scan)."""


def _small_alone(extra: list[str]) -> list[str]:
    """A recipe's small model trained on the whole budget, without its growth."""
    return [o for o in extra if not o.startswith("growth.")]


def _budget(study: Study, arch: dict, tokens: int) -> tuple[float, float]:
    """(FLOPs of ``tokens`` for the target ``arch``, its block FLOPs share)."""
    from pretrain.config import make_plan
    from pretrain.model.growth_stages import block_flops_share

    cfg = study.config(model_overrides(arch))
    seq_len = make_plan(cfg, cfg.cluster.num_workers).seq_len
    return budget_flops(cfg, tokens), block_flops_share(cfg.model, seq_len, cfg.moe)


def small_model(target: dict, extra: list[str]) -> dict:
    """The architecture a recipe starts from (its ``model.*`` overrides on ``target``)."""
    arch = dict(target)
    for o in _small_alone(extra):
        key, value = o.split("=", 1)
        if not key.startswith("model."):
            continue
        arch[key.removeprefix("model.")] = int(value)
    return arch


def alone_name(arch: dict) -> str:
    """The name of a small model trained alone in the study's curves: ``alone LxD``."""
    return f"alone {arch['num_layers']}x{arch['hidden_size']}"


def plan(target: dict, names: list[str], seeds: tuple[int, ...], scan: bool = False) -> list[tuple[str, int, list]]:
    """The study's runs in order, (curve name, seed, overrides): per seed the target from scratch, each recipe
    (none with ``scan``) and each distinct small model of the recipes trained alone on the whole budget."""
    book = recipes(target)
    smalls: dict[str, list[str]] = {}
    for n in names:
        smalls.setdefault(alone_name(small_model(target, book[n])), _small_alone(book[n]))
    runs = []
    for seed in seeds:
        runs.append(("scratch", seed, model_overrides(target)))
        runs += [] if scan else [(n, seed, [*model_overrides(target), *book[n]]) for n in names]
        runs += [(name, seed, [*model_overrides(target), *extra]) for name, extra in smalls.items()]
    return runs


def growth_bench(
    overrides: list[str],
    *,
    tokens: int | None = None,
    seeds: tuple[int, ...] = (0, 1),
    only: list[str] | None = None,
    sizes: bool | None = False,
    scan: bool = False,
    points: int = VAL_POINTS,
    root: Path | None = None,
    reuse: tuple[Path, ...] = (),
    tokens_per_param: float = TOKENS_PER_PARAM,
    jobs: int = 1,
    check: float | None = None,
) -> dict:
    """The study; ``tokens`` None: ``tokens_per_param`` per target parameter; ``only`` limits the recipes;
    ``sizes`` forces (True) or skips (False) the trend (None: when the best recipe saves < 25 %); ``scan``: only
    the iso-FLOP scan (the target from scratch and the recipes' small models alone, no growth); ``reuse``: earlier
    studies' stores whose matching runs are read instead of trained (:mod:`benchmarks.reuse`); ``jobs``: runs
    trained side by side (:meth:`Study.train_many`; the trend's runs train one at a time); ``check``: also train each
    recipe on ``1 - check`` of the budget, fully decayed there (:mod:`benchmarks.growth_check`; refused with ``scan``).
    Returns the study's dict (see :func:`summary`)."""
    check_share(check, scan)
    vocab = vocab_of(overrides, VOCAB)
    corpus, corpus_name, manifest = corpus_overrides(overrides, vocab)
    base = study_base(vocab, corpus, overrides, val_sequences=VAL_SEQUENCES)
    target = {**TARGET, **{k.split(".")[1]: int(v) for k, v in _split(overrides) if k.split(".")[1] in TARGET}}
    base = [o for o in base if o.split("=")[0].removeprefix("model.") not in TARGET]
    study = Study("bench-growth", ROOT / "configs" / "demo-decoder.yaml", base, root, reuse)
    params = _parameters(study, target)
    tokens = tokens or int(round(tokens_per_param * params, -3))
    flops, share = _budget(study, target, tokens)
    known = list(recipes(target))
    names = list(DEFAULT_RECIPES) if only is None else [n for n in known if n in only]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise SystemExit(
            f"bench --growth --recipes: unknown {', '.join(unknown)} (known: {', '.join(recipes(target))})"
        )
    if not scan:
        recipe_book = {n: recipes(target)[n] for n in names}
        check_grows_into_target(study.config, model_overrides(target), recipe_book, flops)
    trend_ok, trend_skipped = runnable_sizes(study.config, sizes_of(target), recipes, names, flops)
    if sizes and trend_skipped and not scan:  # asked for: refused before anything trains
        raise SystemExit(f"bench --growth --sizes: {trend_skipped[0]['why']} (at {trend_skipped[0]['target']})")
    runs = plan(target, names, seeds, scan)
    # the run that reads most tokens starts at the smallest model (a grown run reads fewer than its model alone)
    archs = {n: small_model(target, extra[len(model_overrides(target)) :]) for n, _, extra in runs}
    per_token = {n: _budget(study, a, 1)[0] for n, a in archs.items()}
    most = flops / min(per_token.values())
    passes = epochs(most, manifest, f"bench --growth: the budget ({tokens:,} target tokens)")
    repeat = ["data.repeat=true"] if passes is not None and passes > 1 else []
    out: dict = {
        "target": target,
        "target_parameters": params,
        "block_flops_share": share,
        "budget_flops": flops,
        "budget_tokens": tokens,
        "tokens_per_param": tokens / params,
        "corpus": corpus_name,
        "corpus_epochs_max": passes,
        "seeds": list(seeds),
        "recipes": {n: recipes(target)[n] for n in names},
        "small_models": {n: alone_name(small_model(target, recipes(target)[n])) for n in names},
        "scan": scan,
        "data_repeat": repeat,
        "curves": {},
        "run_ids": {},
    }
    budget = [*repeat, *budget_overrides(flops, points)]
    todo = [(n, seed, [*extra, f"train.seed={seed}", *budget]) for n, seed, extra in runs]
    if check is not None:
        book = {n: [*model_overrides(target), *e] for n, e in recipes(target).items()}
        checks = check_runs(book, names, seeds, flops, check, points)
        todo += [(n, seed, [*extra, f"train.seed={seed}", *repeat]) for n, seed, extra in checks]
    trained = study.train_many([(f"{n} seed {seed}", extra) for n, seed, extra in todo], jobs, True)
    out["jobs"] = jobs
    out["in_context_copying"] = {}
    for (name, seed, _), run in zip(todo, trained):
        out["curves"].setdefault(name, {})[seed] = run.flops
        out["run_ids"].setdefault(name, {})[seed] = run.run_id
        out["in_context_copying"].setdefault(name, {})[seed] = _copying(study, run)
    if not scan:
        savings = {n: {s: flops_saving(out["curves"]["scratch"][s], out["curves"][n][s]) for s in seeds} for n in names}
        out["growth_flops_saving_per_seed"] = savings
        out["growth_flops_saving"] = {n: _min_saving(v.values()) for n, v in savings.items()}
        mean = {n: mean_curve([out["curves"][n][s] for s in seeds]) for n in ["scratch", *names]}
        out["growth_flops_saving_mean_curve"] = {n: flops_saving(mean["scratch"], mean[n]) for n in names}
        ranked = sorted(
            names, key=lambda n: -1e9 if out["growth_flops_saving"][n] is None else out["growth_flops_saving"][n]
        )
        out["best_recipe"] = ranked[-1] if ranked else None
        if check is not None:
            out["saving_checked"] = checked(out["curves"], names, list(seeds), check, flops)
    out.update(alternatives(out))
    out["iso_flop"] = iso_flop(out, {n: _parameters(study, a) for n, a in archs.items()}, per_token)
    best = out.get("best_recipe")
    if best and (sizes or (sizes is None and (out["growth_flops_saving"][best] or -1) < 0.25)):
        out["trend"] = _trend(study, out, best, tokens, seeds[0], points, trend_ok)
        out["trend_skipped"] = trend_skipped
    figure = _plot(out, study.work / "growth_vs_scratch.png")
    out["plot"] = str(figure)
    out["mlflow"] = {"tracking_uri": study.uri, "parent_run": study.parent}
    out["reused_runs"] = study.reused
    study.finish(summary(out), figure)
    return out


def _copying(study: Study, run) -> dict:
    """:func:`benchmarks.copying.copying_probe` of ``run``'s final model (read from its checkpoints)."""
    from benchmarks.copying import copying_probe
    from eval.generator import load_generator

    with study.inside():
        model = load_generator(run.source).model
    return copying_probe(model, model.config.vocab_size)


def alternatives(out: dict) -> dict:
    """Per seed, against what a user could train instead at the same FLOPs: ``final_loss`` of every run,
    ``small_alone_final_loss`` per recipe, ``target_ahead_of_small`` (the target from scratch ends below every small
    model alone) and ``grown_vs_best_alternative`` (the best recipe's final loss minus the lower of scratch's and
    every small model's alone; < 0: growth won; None without a best recipe)."""
    curves, seeds = out["curves"], out["seeds"]
    final = {name: {s: per[s][-1][1] for s in seeds} for name, per in curves.items()}
    alone = sorted(set(out["small_models"].values()))
    res: dict = {
        "final_loss": final,
        "small_alone_final_loss": {n: final[small] for n, small in out["small_models"].items()},
        "target_ahead_of_small": {s: all(final["scratch"][s] < final[a][s] for a in alone) for s in seeds},
    }
    best = out.get("best_recipe")
    res["grown_vs_best_alternative"] = {
        s: None if best is None else final[best][s] - min([final["scratch"][s], *(final[a][s] for a in alone)])
        for s in seeds
    }
    return res


def iso_flop(out: dict, params: dict[str, int], per_token: dict[str, float]) -> list[dict]:
    """The iso-FLOP scan from the study's runs: the target from scratch and each small model alone, all on the
    budget, largest first: parameters, tokens, tokens per parameter, final loss per seed and, for a small model, the
    share of the budget from which the target is ahead of it (None: never)."""
    rows = []
    for name in ["scratch", *sorted(set(out["small_models"].values()), key=lambda a: -params[a])]:
        tokens = out["budget_flops"] / per_token[name]
        row = {
            "model": name,
            "parameters": params[name],
            "tokens": tokens,
            "tokens_per_param": tokens / params[name],
            "final_loss": {s: out["curves"][name][s][-1][1] for s in out["seeds"]},
        }
        if name != "scratch":
            ahead = {s: ahead_from(out["curves"]["scratch"][s], out["curves"][name][s]) for s in out["seeds"]}
            row["target_ahead_from"] = {s: None if x is None else x / out["budget_flops"] for s, x in ahead.items()}
        rows.append(row)
    return rows


def _parameters(study: Study, arch: dict) -> int:
    """Parameters of the decoder ``arch`` under the study's config (tied embeddings once)."""
    return model_parameters(study, model_overrides(arch))


def _split(overrides: list[str]) -> list[tuple[str, str]]:
    return [tuple(o.split("=", 1)) for o in overrides if o.startswith("model.") and "=" in o]  # type: ignore[misc]


def _min_saving(values) -> float | None:
    """The minimum over seeds (a seed that never reaches the scratch loss makes it None)."""
    values = list(values)
    return None if any(v is None for v in values) else min(values)


def _trend(study: Study, out: dict, best: str, tokens: int, seed: int, points: int, archs: list[dict]) -> list[dict]:
    """Per target size of ``archs`` (those every recipe runs at): scratch, the best recipe and its small model alone
    (one seed; at the target all three are the study's runs)."""
    rows = []
    for arch in archs:
        flops, share = _budget(study, arch, tokens)
        budget = [f"train.seed={seed}", *out["data_repeat"], *budget_overrides(flops, points)]
        recipe = recipes(arch)[best]
        label = f"trend {arch['num_layers']}x{arch['hidden_size']}"
        if arch == out["target"]:  # the study's own runs, the small model alone included
            scratch, grown = out["curves"]["scratch"][seed], out["curves"][best][seed]
            small = out["curves"][out["small_models"][best]][seed]
        else:
            scratch = study.train(f"{label} scratch", [*model_overrides(arch), *budget]).flops
            grown = study.train(f"{label} {best}", [*model_overrides(arch), *recipe, *budget]).flops
            small = study.train(f"{label} small alone", [*model_overrides(arch), *_small_alone(recipe), *budget]).flops
        ahead = ahead_from(scratch, small)
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
