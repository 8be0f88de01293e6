"""FLOPs budgets and growth points (``train.max_flops``, ``growth.schedule[i].at_tokens`` / ``at_fraction``): the
steps derived and their one-line refusals."""

from __future__ import annotations

import math
import re

import pytest

from pretrain.config import ConfigError, GrowthStep, load_config
from pretrain.driver.budget import resolve_budget, run_flops, stage_flops_per_step
from pretrain.train.schedule import continue_overrides
from tests.conftest import ROOT
from tests.harness import tiny_model

DEMO = ROOT / "configs" / "demo-decoder.yaml"
SMALL = [*tiny_model(vocab_size=512, hidden_size=64, max_seq_len=None)]
SMALL += ["model.num_kv_heads=2"]


def test_max_flops_and_growth_points_derive_steps():
    lines: list[str] = []
    per_token = 16 * 128  # tokens per step of the demo: 16 sequences of 128
    over = [*SMALL, "growth.schedule=[{at_tokens: 5000, depth: 2x}, {at_fraction: 0.5, width: 2x}]"]
    cfg = load_config(DEMO, [*over, "train.max_flops=4e12"])
    resolve_budget(cfg, say=lines.append)
    first, second = cfg.growth.schedule
    assert first.at_step == math.ceil(5000 / per_token) == 3
    per_step = stage_flops_per_step(cfg)
    assert len(per_step) == 3 and per_step[0] < per_step[1] < per_step[2]
    assert run_flops(cfg, second.at_step - 1) < 0.5 * 4e12 <= run_flops(cfg, second.at_step)
    assert run_flops(cfg, cfg.train.max_steps - 1) < 4e12 <= run_flops(cfg)
    assert lines == [
        "growth.schedule[0]: at_tokens 5,000 -> at_step 3 (2,048 tokens/step)",
        f"growth.schedule[1]: at_fraction 0.5 of train.max_flops 4e+12 -> at_step {second.at_step}",
        f"train.max_flops 4e+12 -> train.max_steps {cfg.train.max_steps} ({per_step[2]:.4g} FLOPs/step after the "
        "last growth)",
    ]
    again: list[str] = []
    steps = (first.at_step, second.at_step, cfg.train.max_steps)
    resolve_budget(cfg, say=again.append)  # a resume derives the same steps and says nothing
    assert again == [] and (first.at_step, second.at_step, cfg.train.max_steps) == steps
    plain = load_config(DEMO, [*SMALL, "train.max_flops=1e12"])
    resolve_budget(plain, say=lambda _: None)
    assert plain.train.max_steps == math.ceil(1e12 / stage_flops_per_step(plain)[0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["growth.schedule=[{at_fraction: 0.1, depth: 2x}]"],
            "growth.schedule[0].at_fraction: a fraction of the FLOPs budget needs train.max_flops > 0",
        ),
        (
            ["train.max_flops=1e12", "growth.schedule=[{at_fraction: 0.1, at_tokens: 10, depth: 2x}]"],
            "growth.schedule[0]: set one of at_tokens and at_fraction",
        ),
        (["growth.schedule=[{at_fraction: 1.5, depth: 2x}]"], "at_fraction in (0, 1)"),
        (["growth.schedule=[{depth: 2x}]"], "growth.schedule[0]: no growth point: set train.max_flops to grow at"),
        (["train.max_flops=-1"], "train.max_flops: must be >= 0"),
        (["train.val_every_flops=-1"], "train.val_every_flops: must be >= 0"),
    ],
)
def test_bad_budgets_are_refused_by_key(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(DEMO, [*SMALL, *overrides])


def test_an_entry_without_a_point_or_a_target_follows_the_study_recipe():
    """The defaults are the growth study's best recipe: half the depth stacked (``depth: 2x``) at ``at_fraction``
    0.1 of the budget (``docs/growth.md``)."""
    assert GrowthStep().depth == "4x" and GrowthStep(width="2x").depth == ""
    lines: list[str] = []
    cfg = load_config(DEMO, [*SMALL, "train.max_flops=4e12", "growth.schedule=[{}]"])
    resolve_budget(cfg, say=lines.append)
    (entry,) = cfg.growth.schedule
    assert entry.depth == "4x" and entry.depth_op == "stack"
    want = "growth.schedule[0]: at_fraction 0.1 (the default point) of train.max_flops 4e+12 -> at_step"
    assert lines[0] == f"{want} {entry.at_step}"
    assert run_flops(cfg, entry.at_step - 1) < 0.1 * 4e12 <= run_flops(cfg, entry.at_step)
    assert cfg.growth.rewarm(cfg.train.warmup_steps) == cfg.train.warmup_steps, "re-warmed over the warm-up"


def test_budgets_that_cannot_hold_are_refused_when_resolved():
    spent = load_config(DEMO, [*SMALL, "train.max_flops=1e9", "growth.schedule=[{at_tokens: 100000, depth: 2x}]"])
    with pytest.raises(ConfigError, match="train.max_flops: 1e\\+09 is spent before the last growth"):
        resolve_budget(spent, say=lambda _: None)
    backwards = load_config(DEMO, [*SMALL, "growth.schedule=[{at_tokens: 100000, depth: 2x}, {at_step: 3, width: 2x}]"])
    with pytest.raises(ConfigError, match=r"growth.schedule\[1\]: at step 3, not after the growth before it"):
        resolve_budget(backwards, say=lambda _: None)
    fractions = ["train.max_flops=4e12", "growth.schedule=[{at_tokens: 100000, depth: 2x}, {at_fraction: 0.001}]"]
    with pytest.raises(
        ConfigError, match=re.escape("growth.schedule[1]: at_fraction 0.001 of train.max_flops is spent")
    ):
        resolve_budget(load_config(DEMO, [*SMALL, *fractions]), say=lambda _: None)


def test_a_resolved_config_keeps_its_derived_steps_beside_their_points():
    """A run's stored config records each derived ``at_step`` beside its ``at_tokens`` / ``at_fraction``: loaded as
    a stored config (``base=``), as resume and the derived runs do, it is accepted."""
    from pretrain.config import to_dict

    cfg = load_config(DEMO, [*SMALL, "train.max_flops=4e12", "growth.schedule=[{at_fraction: 0.5, depth: 2x}]"])
    resolve_budget(cfg, say=lambda _: None)
    assert load_config(None, base=to_dict(cfg)).growth.schedule[0].at_step == cfg.growth.schedule[0].at_step > 0


def test_a_resume_keeps_the_derived_steps():
    """A checkpoint after a growth records the grown model, so a resume never derives again: a new budget, or a
    growth point that would need deriving, is refused in one line."""
    from pretrain.driver.budget import keep_resolved_budget

    saved = load_config(DEMO, [*SMALL, "train.max_flops=4e12", "growth.schedule=[{at_fraction: 0.5, depth: 2x}]"])
    resolve_budget(saved, say=lambda _: None)
    keep_resolved_budget(saved, saved)
    more = load_config(DEMO, [*SMALL, "train.max_flops=8e12", "growth.schedule=[{at_fraction: 0.5, depth: 2x}]"])
    with pytest.raises(ConfigError, match=r"train.max_flops: 4e\+12 -> 8e\+12: a budget is resolved into"):
        keep_resolved_budget(saved, more)
    added = load_config(DEMO, [*SMALL, "growth.schedule=[{at_tokens: 5000, depth: 2x}]"])
    with pytest.raises(ConfigError, match=r"growth.schedule\[0\]: a growth added on resume needs its point"):
        keep_resolved_budget(saved, added)


def test_continuing_a_budgeted_run_lifts_the_budget():
    cfg = load_config(DEMO, [*SMALL, "train.max_flops=1e12"])
    assert continue_overrides(cfg.train, 100, 400)[0] == "train.max_flops=0"  # else max_steps is derived again
    assert "train.max_flops=0" not in continue_overrides(load_config(DEMO, SMALL).train, 100, 400)


@pytest.mark.parametrize(
    "schedule, message",
    [
        ("[{at_step: 10, width: 1.5x}]", "growth.schedule[0]: width_op tile needs integer factors: hidden size 64"),
        ("[{at_step: 10, depth: 2}]", "growth.schedule[0]: depth 2 is smaller than the model's 4 blocks"),
        ("[{at_step: 10, experts: 4, top_k: 1}, {at_step: 20, experts: 4}]", "growth.schedule[1]: experts: the model"),
        ("[{at_step: 10, depth: 2x}, {at_step: 20, depth: 6}]", "growth.schedule[1]: depth 6 is smaller than"),
        ("[{at_step: 10, depth: 1000000000}]", "growth.schedule[0].depth: 1000000000 grows model.num_layers to 1,0"),
        ("[{at_step: 10, heads: 100000}]", "growth.schedule[0].heads: 100000 grows model.hidden_size to 1,600,000"),
    ],
)
def test_growth_that_cannot_apply_is_refused_naming_its_entry(schedule, message):
    """Each entry is applied to a weightless model of the stage before it (the vocabulary size still 0, as before
    the tokenizer is known), so a growth that would fail mid-run is a one-line ConfigError."""
    from pretrain.driver.budget import check_growth_stages

    cfg = load_config(DEMO, [*tiny_model(hidden_size=64, num_layers=4, vocab_size=None), f"growth.schedule={schedule}"])
    assert cfg.model.vocab_size == 0
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_growth_stages(cfg)


@pytest.mark.parametrize(
    "schedule, message",
    [
        ("[{at_step: 5, experts: 4}]", "growth.schedule[0]: the model it grows to: parallel.tensor: not with MoE"),
        (
            "[{at_step: 5, heads: 6, width_op: net2net}]",
            "growth.schedule[0]: the model it grows to: parallel.tensor: 2 must divide model.num_heads (6)",
        ),
    ],
)
def test_growth_into_a_model_the_parallel_layout_cannot_split_is_refused(schedule, message):
    """The grown model's config passes the checks the job makes at the growth (here tensor parallelism against MoE
    and the heads), before anything starts; a depth growth under the same layout is fine."""
    from pretrain.driver.budget import check_growth_stages

    layout = ["parallel.tensor=2", "cluster.num_workers=2", "data.num_streams=2"]
    model = tiny_model(hidden_size=64, num_layers=4, vocab_size=None)
    check_growth_stages(load_config(DEMO, [*model, *layout, "growth.schedule=[{at_step: 5, depth: 8}]"]))
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_growth_stages(load_config(DEMO, [*model, *layout, f"growth.schedule={schedule}"]))


def test_a_budget_of_more_steps_than_int64_is_refused():
    cfg = load_config(DEMO, [*SMALL, "train.max_flops=1e40"])
    with pytest.raises(ConfigError, match=r"^train\.max_flops: 1e\+40 is .* steps of .* FLOPs, more than 9,223,372"):
        resolve_budget(cfg, say=lambda _: None)


def test_a_budget_over_a_growth_that_cannot_apply_is_a_config_error():
    cfg = load_config(DEMO, [*SMALL, "train.max_flops=4e12", "growth.schedule=[{width: 1.5x}]"])
    with pytest.raises(ConfigError, match=re.escape("growth.schedule[0]: width_op tile needs integer factors")):
        resolve_budget(cfg, say=lambda _: None)


def test_a_stored_config_is_checked_with_only_the_growths_its_model_has_not_had():
    """A checkpoint's config holds the model grown by every entry before its step: a resume applies only the later
    entries to it (an upcycled model is not upcycled again, a depth of 16 not grown to 8)."""
    from pretrain.driver.budget import check_growth_stages

    model = tiny_model(hidden_size=64, num_layers=16, vocab_size=None)
    upcycled = load_config(DEMO, [*model, "moe.num_experts=4", "growth.schedule=[{at_step: 3, experts: 4, top_k: 2}]"])
    with pytest.raises(ConfigError, match=re.escape("growth.schedule[0]:")):
        check_growth_stages(upcycled)  # as if the model had not grown yet
    check_growth_stages(upcycled, grown_at=4)
    deep = load_config(DEMO, [*model, "growth.schedule=[{at_step: 2, depth: 8}, {at_step: 4, depth: 16}]"])
    check_growth_stages(deep, grown_at=5)
    with pytest.raises(ConfigError, match=re.escape("growth.schedule[0]:")):
        check_growth_stages(deep)  # the 16 blocks "grown" to 8
