"""Checks of the growth study: each recipe grows into the target (:func:`check_grows_into_target`), and a growth
saving is checked by the run it claims (``bench --growth --check-saving S``): each recipe trained on
``1 - S`` of the budget, its own schedule fully decayed there, against the target from scratch on the whole budget.

The study's ``growth_flops_saving`` reads where a recipe's curve first reaches the scratch run's final loss, on a
run whose cosine schedule ends at the whole budget: at that point its learning rate has not decayed, so the reading may
understate what the recipe reaches on the shorter budget (the comparison "No Train No Gain", Kaddour et al. 2023,
asks for: every run fully decayed at its own budget). A user who grows to save S of the FLOPs trains on the shorter
budget, so that is the run this module adds, per recipe and seed; ``reaches_scratch`` says whether its final loss is
at or below the scratch run's. The growth point stays ``at_fraction`` of the run's own budget.
"""

from __future__ import annotations

from typing import Any

from benchmarks.curves import Curve

GOAL_SAVING = 0.25
"""The share of the budget a recipe should save (the best recipe reaches the scratch target's final loss with 25 %
fewer training FLOPs on every seed): the value to give ``--check-saving``."""


def check_share(share: float | None, scan: bool) -> None:
    """Refuses, in one line and before anything trains, a share outside (0, 1) or a check with ``--scan`` (which
    trains no recipe)."""
    from pretrain.config import ConfigError

    if share is None:
        return
    if scan:
        raise ConfigError("bench --growth --check-saving: --scan trains no recipe to check; leave one of them out")
    if not 0 < share < 1:
        raise ConfigError(f"bench --growth --check-saving: a share of the budget in (0, 1), got {share}")


def check_name(name: str, share: float) -> str:
    """The curve name of recipe ``name`` checked with ``share`` of the budget saved: ``stack2@10% on 75%``."""
    return f"{name} on {1 - share:.0%}"


def check_runs(
    book: dict[str, list[str]], names: list[str], seeds: tuple[int, ...], flops: float, share: float, points: int
) -> list[tuple[str, int, list[str]]]:
    """(curve name, seed, overrides on the target) of each recipe of ``names`` (``book``: its overrides) on
    ``(1 - share) * flops``, validated on the whole budget's grid (every ``flops / points``) and at its last step."""
    check_share(share, scan=False)
    budget = [
        f"train.max_flops={flops * (1 - share):.6g}",
        "train.val_every=0",
        f"train.val_every_flops={flops / points:.6g}",
    ]
    return [(check_name(n, share), seed, [*book[n], *budget]) for seed in seeds for n in names]


def checked(
    curves: dict[str, dict[int, Curve]], names: list[str], seeds: list[int], share: float, flops: float
) -> dict[str, Any]:
    """The check from the study's ``curves`` (the scratch run's and those of :func:`check_runs`): per recipe and seed
    the final loss, its margin over the scratch run's final loss (< 0: below it) and ``reaches_scratch`` (at or
    below it); ``reaches_on_every_seed`` per recipe."""
    scratch = curves["scratch"]
    final = {n: {s: curves[check_name(n, share)][s][-1][1] for s in seeds} for n in names}
    margin = {n: {s: final[n][s] - scratch[s][-1][1] for s in seeds} for n in names}
    return {
        "share_saved": share,
        "budget_flops": flops * (1 - share),
        "final_loss": final,
        "vs_scratch_final": margin,
        "reaches_scratch": {n: {s: margin[n][s] <= 0 for s in seeds} for n in names},
        "reaches_on_every_seed": {n: all(margin[n][s] <= 0 for s in seeds) for n in names},
    }


def check_grows_into_target(config, target: list[str], recipes: dict[str, list[str]], flops: float) -> None:
    """Each recipe's last stage is the target model (the fields that shape it, embeddings tied or not): a recipe that
    grows into another model is refused before anything trains, since "grown against scratch" would then compare
    two models (e.g. ``tile2@10%`` where the target has one key-value head: tiling doubles it). ``config(overrides)``:
    the study's config with ``overrides`` (:meth:`benchmarks.study.Study.config`); ``target``: the target's
    ``model.*`` overrides; ``recipes``: name -> the recipe's overrides on the target."""
    from pretrain.model.growth_stages import stage_architectures

    def shape(m) -> dict:
        keys = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "tie_embeddings")
        return {**{k: getattr(m, k) for k in keys}, "ffn_size": m.ffn_width()}

    want = shape(config(target).model)
    for name, overrides in recipes.items():
        cfg = config([*target, *overrides, f"train.max_flops={flops}"])
        got = shape(stage_architectures(cfg.model, cfg.moe, cfg.growth.schedule)[-1][0])
        wrong = [f"{k} {got[k]} (target {want[k]})" for k in want if got[k] != want[k]]
        if wrong:
            raise SystemExit(
                f"bench --growth: recipe {name} grows into another model than the target: {', '.join(wrong)}"
            )


def runnable_sizes(config, archs: list[dict], book, names: list[str], flops: float) -> tuple[list[dict], list[dict]]:
    """The trend's target sizes (``archs``) where every recipe of ``names`` is a valid run, and the others with why
    (e.g. ``stack4`` of a 2-block target: a 0-block small model), checked before anything trains. ``book(arch)``:
    recipe name -> its overrides at that size."""
    from pretrain.config import ConfigError

    ok, skipped = [], []
    for arch in archs:
        why = ""
        for name in names:
            try:
                config([*(f"model.{k}={v}" for k, v in arch.items()), *book(arch)[name], f"train.max_flops={flops}"])
            except ConfigError as e:
                why = f"{name}: {e}"
                break
        if why:
            skipped.append({"target": arch, "why": why})
        else:
            ok.append(arch)
    return ok, skipped
