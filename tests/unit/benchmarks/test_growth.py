"""The growth study's plan and its comparison with the alternatives a user has, on known curves
(``benchmarks/growth.py``; the study itself: ``tests/integration/bench/test_studies.py``)."""

from __future__ import annotations

import pytest

from benchmarks.growth import TARGET, alternatives, iso_flop, model_overrides, plan, recipes, small_model
from benchmarks.growth_check import check_grows_into_target, check_runs, check_share, checked
from benchmarks.study import epochs
from pretrain.config import ConfigError, load_config

ARCH = {"num_layers": 4, "hidden_size": 128, "num_heads": 4, "num_kv_heads": 2}
"""A target for the plan's arithmetic (any 4-block one whose half width keeps whole heads)."""


def test_plan_trains_each_small_model_alone_once_per_seed():
    names = ["stack4@10%", "stack2@10%", "stack2@20%", "tile2@10%"]
    runs = plan(ARCH, names, (0, 1))
    per_seed = [name for name, seed, _ in runs if seed == 0]
    assert per_seed == ["scratch", *names, "alone 1x128", "alone 2x128", "alone 4x64"]
    assert [seed for *_, seed, _ in runs] == [0] * 8 + [1] * 8
    alone = dict((name, extra) for name, seed, extra in runs if seed == 1)["alone 1x128"]
    assert not [o for o in alone if o.startswith("growth.")] and alone[-1] == "model.num_layers=1"
    assert small_model(ARCH, recipes(ARCH)["tile2@10%"]) == {
        **ARCH,
        "hidden_size": 64,
        "num_heads": 2,
        "num_kv_heads": 1,
    }
    assert [name for name, seed, _ in plan(ARCH, names[:2], (0,), scan=True)] == [
        "scratch",
        "alone 1x128",
        "alone 2x128",
    ]


def _curve(*losses: float) -> list[tuple[float, float]]:
    return [(float(i + 1), v) for i, v in enumerate(losses)]


def test_alternatives_and_the_iso_flop_scan_from_known_curves():
    out = {
        "seeds": [0, 1],
        "budget_flops": 4.0,
        "best_recipe": "stack4@10%",
        "small_models": {"stack4@10%": "alone 1x128", "stack2@10%": "alone 2x128"},
        "curves": {
            "scratch": {0: _curve(6.0, 5.0, 4.2, 3.9), 1: _curve(6.0, 5.0, 4.5, 4.1)},
            "stack4@10%": {0: _curve(5.5, 4.5, 4.0, 3.8), 1: _curve(5.5, 4.5, 4.1, 4.05)},
            "stack2@10%": {0: _curve(5.8, 4.8, 4.1, 3.85), 1: _curve(5.8, 4.8, 4.3, 4.2)},
            "alone 1x128": {0: _curve(5.0, 4.4, 4.1, 4.0), 1: _curve(5.0, 4.4, 4.1, 4.0)},
            "alone 2x128": {0: _curve(5.2, 4.5, 4.0, 3.95), 1: _curve(5.2, 4.5, 4.0, 3.9)},
        },
    }
    got = alternatives(out)
    assert got["small_alone_final_loss"] == {"stack4@10%": {0: 4.0, 1: 4.0}, "stack2@10%": {0: 3.95, 1: 3.9}}
    assert got["target_ahead_of_small"] == {0: True, 1: False}, "seed 1: the 2-block model alone ends below"
    assert got["grown_vs_best_alternative"][0] == pytest.approx(3.8 - 3.9), "growth beats scratch"
    assert got["grown_vs_best_alternative"][1] == pytest.approx(4.05 - 3.9), "the 2-block model alone wins"
    assert alternatives({**out, "best_recipe": None})["grown_vs_best_alternative"] == {0: None, 1: None}

    params = {"scratch": 1000, "alone 1x128": 400, "alone 2x128": 600}
    per_token = {"scratch": 0.1, "alone 1x128": 0.04, "alone 2x128": 0.06}
    rows = iso_flop(out, params, per_token)
    assert [r["model"] for r in rows] == ["scratch", "alone 2x128", "alone 1x128"], "largest first"
    assert rows[0]["tokens"] == pytest.approx(40.0) and rows[0]["tokens_per_param"] == pytest.approx(0.04)
    assert rows[2]["tokens"] == pytest.approx(100.0) and rows[2]["final_loss"] == {0: 4.0, 1: 4.0}
    # scratch 0: 6, 5, 4.2, 3.9 against 1x128's 5, 4.4, 4.1, 4.0: ahead from FLOPs 4 (of 4)
    assert rows[2]["target_ahead_from"] == {0: 1.0, 1: None} and "target_ahead_from" not in rows[0]


def test_epochs_of_the_corpus():
    manifest = {"train": {"tokens": 1000}}
    assert epochs(2500, manifest, "x") == 2.5 and epochs(10, None, "x") is None
    with pytest.raises(ConfigError, match=r"x: reads 4,001 tokens, 4.00 epochs .* \(at most 4\)"):
        epochs(4001, manifest, "x")


def test_the_default_and_gpu_sizes_are_the_documented_ones():
    """docs/growth.md's table: 0.33M target parameters on the CPU, 3.5M at the GPU size (2,048-token vocabulary)."""
    import torch

    from benchmarks.growth import GPU_PRESET, TARGET, VOCAB, model_overrides
    from pretrain.config import load_config
    from pretrain.model.counting import num_parameters
    from pretrain.model.transformer import SkipInitOnMeta, Transformer
    from tests.harness import ROOT

    def params(overrides):
        cfg = load_config(ROOT / "configs" / "demo-decoder.yaml", [f"model.vocab_size={VOCAB}", *overrides])
        with torch.device("meta"), SkipInitOnMeta():
            return num_parameters(Transformer(cfg.model, cfg.moe)), cfg

    cpu, _ = params(model_overrides(TARGET))
    gpu, cfg = params(GPU_PRESET)
    assert round(cpu / 1e4) == 33 and round(gpu / 1e5) == 35
    assert cfg.train.precision == "bf16" and cfg.model.max_seq_len == 512 and cfg.model.num_heads * 32 == 256


def test_a_saving_is_checked_by_a_run_on_the_shorter_budget():
    book = recipes(ARCH)
    runs = check_runs(book, ["stack2@10%", "stack4@10%"], (0, 1), 8.0, 0.25, 4)
    assert [(name, seed) for name, seed, _ in runs] == [
        ("stack2@10% on 75%", 0),
        ("stack4@10% on 75%", 0),
        ("stack2@10% on 75%", 1),
        ("stack4@10% on 75%", 1),
    ]
    extra = runs[0][2]
    assert extra[: len(book["stack2@10%"])] == book["stack2@10%"], "the recipe as it is, growth point included"
    assert "train.max_flops=6" in extra and "train.val_every_flops=2" in extra, "3/4 of the FLOPs, the same grid"
    with pytest.raises(ConfigError, match="--check-saving: a share of the budget in"):
        check_runs(book, ["stack2@10%"], (0,), 8.0, 1.0, 4)
    with pytest.raises(ConfigError, match="--check-saving: --scan trains no recipe"):
        check_share(0.25, scan=True)
    check_share(None, scan=True)
    curves = {
        "scratch": {0: _curve(6.0, 5.0, 4.2, 3.9), 1: _curve(6.0, 5.0, 4.5, 4.1)},
        "stack2@10% on 75%": {0: _curve(5.5, 4.5, 3.85), 1: _curve(5.5, 4.5, 4.2)},
    }
    got = checked(curves, ["stack2@10%"], [0, 1], 0.25, 8.0)
    assert got["reaches_scratch"] == {"stack2@10%": {0: True, 1: False}}
    assert got["vs_scratch_final"]["stack2@10%"][0] == pytest.approx(-0.05)
    assert got["reaches_on_every_seed"] == {"stack2@10%": False} and got["budget_flops"] == 6.0


def test_a_recipe_that_grows_into_another_model_is_refused_before_anything_trains():
    """Tiling doubles every width, key-value heads included, and unties the embeddings: on the study's target (one
    key-value head, tied) ``tile2@10%`` ends in another model, where the stacking recipes end in the target."""

    def config(overrides):
        return load_config(None, ["model.vocab_size=2048", *overrides])

    def check(target: dict, names: list[str]) -> None:
        check_grows_into_target(config, model_overrides(target), {n: recipes(target)[n] for n in names}, 1e13)

    check(TARGET, ["stack2@10%", "stack4@10%"])
    with pytest.raises(
        SystemExit, match=r"recipe tile2@10% grows into another model than the target: .*num_kv_heads 2"
    ):
        check(TARGET, ["stack2@10%", "tile2@10%"])
    check(ARCH, ["stack2@10%"])  # any stacking target


def test_trend_sizes_where_a_recipe_makes_no_model_are_known_before_anything_trains():
    """The default recipe stacks a quarter of the depth: at the trend's 2- and 3-block targets that is no block."""
    from benchmarks.growth import DEFAULT_RECIPES, TARGET, recipes, sizes_of
    from benchmarks.growth_check import runnable_sizes
    from pretrain.config import load_config

    ok, skipped = runnable_sizes(lambda o: load_config(None, o), sizes_of(TARGET), recipes, list(DEFAULT_RECIPES), 1e12)
    assert ok == [TARGET] and [s["target"]["num_layers"] for s in skipped] == [2, 3]
    assert skipped[0]["why"] == "stack4@10%: model.num_layers: must be > 0, got 0"
    ok, skipped = runnable_sizes(lambda o: load_config(None, o), sizes_of(TARGET), recipes, ["stack2@10%"], 1e12)
    assert ok == sizes_of(TARGET) and skipped == []


def test_the_trend_trains_only_the_smaller_targets_and_reads_the_studys_own_runs_at_the_target():
    """At the study's target, scratch, the best recipe and its small model alone are the study's runs (read, not
    trained again); each smaller size trains its three."""
    from types import SimpleNamespace

    from benchmarks.growth import _trend, alone_name, sizes_of

    class Trainer:  # the part of benchmarks.study.Study that _trend uses: a config and a run per name
        def __init__(self):
            self.trained: list[str] = []

        def config(self, overrides):
            return load_config(None, ["model.vocab_size=512", *overrides])

        def train(self, name, overrides):
            self.trained.append(name)
            return SimpleNamespace(flops=_curve(5.0, 4.0, 3.5))

    best, small = "stack2@10%", alone_name(small_model(ARCH, recipes(ARCH)["stack2@10%"]))
    out = {
        "target": ARCH,
        "data_repeat": [],
        "small_models": {best: small},
        "curves": {
            "scratch": {0: _curve(5.0, 4.0, 3.0)},
            best: {0: _curve(5.0, 3.9, 3.1)},
            small: {0: _curve(4.0, 3.6)},
        },
    }
    study = Trainer()
    archs = sizes_of(ARCH)
    rows = _trend(study, out, best, 1000, 0, 5, archs)  # type: ignore[arg-type]
    smaller = [f"trend {a['num_layers']}x{a['hidden_size']}" for a in archs if a != ARCH]
    assert study.trained == [f"{label} {what}" for label in smaller for what in ("scratch", best, "small alone")]
    (at_target,) = [row for row in rows if row["target"] == ARCH]
    assert at_target["curves"] == {
        "scratch": out["curves"]["scratch"][0],
        best: out["curves"][best][0],
        "small alone": out["curves"][small][0],
    }
