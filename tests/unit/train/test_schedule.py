"""LR schedules as pure functions of the step: warm-up, cosine/linear/constant and warmup-stable-decay."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pretrain.config import ConfigError, TrainConfig, load_config
from pretrain.train.schedule import (
    continue_overrides,
    decay_start,
    extension_refusal,
    keeps_schedule,
    lr_at,
    raises_lr,
    schedule_warning,
    train_longer,
    wsd_decay_steps,
)
from tests.conftest import ROOT


def train_cfg(*overrides):
    return load_config(
        None, ["train.lr=1.0", "train.min_lr_ratio=0.1", "train.max_steps=100", "train.warmup_steps=10", *overrides]
    ).train


def test_cosine_is_unchanged():
    t = train_cfg()
    assert lr_at(0, t) == pytest.approx(0.1) and lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_cosine_and_linear_end_one_decay_step_above_the_floor(decay):
    """What docs/schedules.md says of the last step (step max_steps - 1): with S = max_steps - warmup_steps decay
    steps, floor + (peak - floor) / S (linear) or floor + (peak - floor) * (1 - cos(pi / S)) / 2 (cosine); the floor
    itself is step max_steps's LR, which no run trains."""
    t = train_cfg(f"train.decay={decay}")
    s = 100 - 10
    above = 1 / s if decay == "linear" else (1 - math.cos(math.pi / s)) / 2
    assert lr_at(99, t) == pytest.approx(0.1 + 0.9 * above, rel=1e-12) and lr_at(99, t) > 0.1
    assert lr_at(100, t) == pytest.approx(0.1)


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_warms_up_holds_the_peak_then_decays_to_the_floor(shape):
    t = train_cfg("train.decay=wsd", "train.decay_steps=20", f"train.decay_shape={shape}")
    lrs = [lr_at(s, t) for s in range(100)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lrs[10:80] == [1.0] * 70  # stable phase: exactly the peak
    decay = lrs[80:]
    assert all(a > b for a, b in zip(decay, decay[1:])) and decay[0] < 1.0
    assert decay[-1] == pytest.approx(0.1)  # the last step is at the floor
    p = 10 / 20  # step 89 is the decay's 10th step of 20
    expected = {"linear": p, "cosine": 0.5 * (1 - math.cos(math.pi * p)), "1-sqrt": math.sqrt(p)}[shape]
    assert lrs[89] == pytest.approx(1.0 - 0.9 * expected)
    assert lr_at(150, t) == pytest.approx(0.1)  # past the end: the floor


def test_wsd_decay_fraction():
    t = train_cfg("train.decay=wsd", "train.decay_fraction=0.25")
    assert wsd_decay_steps(t) == 25
    assert lr_at(74, t) == 1.0 and lr_at(75, t) < 1.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.decay_steps=-1", "train.decay_steps: must be >= 0"),
        ("train.decay_fraction=0", "train.decay_fraction: must be in (0, 1]"),
        ("train.decay_fraction=1.5", "train.decay_fraction: must be in (0, 1]"),
        ("train.decay_shape=sqrt", "train.decay_shape: expected one of linear, cosine, 1-sqrt"),
        ("train.decay_steps=95", "train.decay_steps: 95 is more than the 90 steps after warm-up"),
        (
            "train.activation_checkpointing=some",
            "train.activation_checkpointing: expected one of none, full, selective",
        ),
    ],
)
def test_bad_values_are_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        train_cfg("train.decay=wsd", override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_checks_against_max_steps_wait_for_a_budgets_steps():
    """``train.max_flops`` derives ``max_steps`` when the run is created: a growth point or a decay longer than the
    preset's ``max_steps`` is not refused against it at load, and is checked against the derived steps."""
    from pretrain.config import load_config
    from pretrain.driver.budget import resolve_budget

    budget = ["train.max_flops=1e15", "train.decay=wsd", "train.decay_steps=500", "model.vocab_size=512"]
    grown = "growth.schedule=[{at_step: 500, depth: 2x, depth_op: identity}]"
    cfg = load_config(None, [*budget, grown, "train.max_steps=200"])
    assert resolve_budget(cfg, say=lambda line: None).train.max_steps > 600
    # a resume's stored config: its budget's steps were derived when it was created
    cfg.train.max_steps, cfg.train.decay_steps = 400, 100
    with pytest.raises(ConfigError, match=r"^growth.schedule\[0\].at_step: must be in \[1, train.max_steps\)"):
        cfg.validate(steps_known=True)
    small = load_config(None, [*budget, "train.max_flops=1e12", "train.max_steps=200"])
    with pytest.raises(ConfigError, match=r"^train.decay_steps: 500 is more than the -?\d+ steps after warm-up"):
        resolve_budget(small, say=lambda line: None)


@pytest.mark.parametrize("value, mode", [("true", "full"), ("false", "none"), ("selective", "selective")])
def test_activation_checkpointing_booleans_still_work(value, mode):
    assert train_cfg(f"train.activation_checkpointing={value}").activation_checkpointing == mode


# -- extending a run: the schedule of the steps trained is kept, the LR never jumps ---------------------------------


def _presets() -> list[tuple[str, TrainConfig]]:
    """One preset of each (warm-up, max_steps) the presets schedule (warm-up 20 to 10,000 steps), named by all."""
    by_schedule: dict[tuple[int, int], list[tuple[str, TrainConfig]]] = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        t = load_config(path).train
        by_schedule.setdefault((t.warmup_steps, t.max_steps), []).append((path.stem, t))
    return [("+".join(name for name, _ in group), group[0][1]) for group in by_schedule.values()]


PRESETS = _presets()
DECAYS = ("cosine", "linear", "constant", "wsd")


def _point(t: TrainConfig, where: str) -> int:
    """A step the run is resumed after: inside the warm-up, at its end, or after the decay began."""
    w = t.warmup_steps
    return {"inside": w // 2, "end": w, "decayed": (decay_start(t) or w) + max(2, w // 2)}[where]


def _lrs(t: TrainConfig, steps: range) -> list[float]:
    return [lr_at(s, t) for s in steps]


@pytest.mark.parametrize("where", ["inside", "end", "decayed"])
@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("finished", [True, False], ids=["smoke-test-extended", "interrupted-extended"])
@pytest.mark.parametrize("preset", PRESETS, ids=[name for name, _ in PRESETS])
def test_extending_a_preset_keeps_its_schedule_and_refuses_only_a_decay_moved(preset, decay, finished, where):
    """A run of a preset's schedule resumed with a larger train.max_steps: ``finished``: a smoke test of ``step``
    steps (its max_steps) extended to the preset's; else the preset interrupted at ``step``, extended to twice its
    max_steps. Inside the warm-up, at its end, and for a constant run, max_steps alone continues the uninterrupted
    run's LRs exactly; after a decay began that is refused in one line, and the command it names holds the LR
    reached, without a new warm-up."""
    _, preset_train = preset
    base = dataclasses.replace(preset_train, decay=decay)
    step = _point(base, where)
    saved = dataclasses.replace(base, max_steps=step) if finished else base
    target = base.max_steps if finished else 2 * base.max_steps
    if where == "decayed" and finished:
        step = saved.max_steps = _point(saved, where)  # a smoke test long enough to decay
    if decay == "wsd" and where == "decayed" and not finished:
        step = saved.max_steps - wsd_decay_steps(saved) // 2
    longer = dataclasses.replace(saved, max_steps=target)  # max_steps alone: the uninterrupted run of target steps
    decayed = decay_start(saved) is not None and step > decay_start(saved)
    assert decayed == (where == "decayed" and decay != "constant")
    # the rule, from what the schedule is a function of, agrees with the LRs themselves
    assert keeps_schedule(saved, longer, step) == (_lrs(saved, range(step)) == _lrs(longer, range(step)))
    assert keeps_schedule(saved, longer, step) == (not decayed)
    overrides = continue_overrides(saved, step, target)
    line = extension_refusal(saved, longer, step)
    if not decayed:
        assert line == "" and overrides == [f"train.max_steps={target}"]
        return
    assert "\n" not in line and f"train.max_steps {saved.max_steps} -> {target} would raise the LR" in line
    assert " ".join(overrides) in line and ("train.decay=wsd" in line or decay == "wsd") and "anneal" in line
    resumed = load_config(None, [f"train.{k}={v}" for k, v in _train_items(saved)] + overrides).train
    assert extension_refusal(saved, resumed, step) == "" and resumed.max_steps == target
    # the LR reached, held: no jump up, no warm-up again
    assert lr_at(step, resumed) == pytest.approx(lr_at(step - 1, saved), rel=1e-7)  # printed to 8 digits
    assert set(_lrs(resumed, range(step, target, max(1, (target - step) // 50)))) == {lr_at(step, resumed)}
    # the floor a later anneal decays to stays the run's
    assert resumed.lr * resumed.min_lr_ratio == pytest.approx(saved.lr * saved.min_lr_ratio, rel=1e-7)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("step", [5, 10, 11, 12, 50, 80, 85, 100])
def test_the_overrides_a_summary_prints_never_raise_the_lr(decay, step):
    saved = train_cfg(f"train.decay={decay}")
    longer = continue_overrides(saved, step, 2 * step)
    assert train_longer(saved, step) == " ".join(longer)
    resumed = load_config(None, [f"train.{k}={v}" for k, v in _train_items(saved)] + longer).train
    assert not raises_lr(saved, resumed, step), longer
    assert resumed.max_steps == 2 * step
    # the steps trained keep their LRs (the next step's then is the uninterrupted run's: at a WSD's last peak step it
    # stays at the peak), or the next step's LR is at most the LR reached
    assert keeps_schedule(saved, resumed, step) or lr_at(step, resumed) <= lr_at(step - 1, saved) * (1 + 1e-7)
    # a constant run, a warm-up (up to its end, and a cosine's step at the peak after it), WSD still at its peak
    # or the same max_steps keeps its schedule: max_steps alone
    start = {"cosine": 11, "linear": 11, "constant": 10**9, "wsd": 80}[decay]
    assert (longer == [f"train.max_steps={2 * step}"]) == (step <= start or 2 * step == saved.max_steps)


def _train_items(t):
    keys = ("lr", "min_lr_ratio", "max_steps", "warmup_steps", "decay", "decay_steps", "decay_fraction", "decay_shape")
    return [(k, getattr(t, k)) for k in keys]


def test_a_longer_cosine_run_is_refused_in_one_line_naming_what_to_use():
    saved = train_cfg()
    line = extension_refusal(saved, dataclasses.replace(saved, max_steps=200), 100)
    assert "\n" not in line and "train.max_steps 100 -> 200 would raise the LR from 0.1 (step 100) to 0.587" in line
    assert "train.max_steps=200 train.decay=constant train.lr=0.10027413 train.min_lr_ratio=0.99726622 " in line
    assert "train.decay=wsd" in line and "anneal" in line
    assert extension_refusal(saved, dataclasses.replace(saved, max_steps=200), 5) == ""  # in warm-up: same LR
    assert extension_refusal(saved, dataclasses.replace(saved, max_steps=50), 40) == ""  # shorter: LR goes down
    assert extension_refusal(saved, dataclasses.replace(saved, lr=0.5), 40) == ""  # a lower peak: LR goes down
    line = extension_refusal(saved, dataclasses.replace(saved, lr=2.0), 60)  # a higher peak mid-decay: a jump
    assert line.endswith("To train on without a jump: train.max_steps=100")  # the schedule as it was
    # a finished cosine extended, its LR at step 5 the one of step 4 (no rise from the LR reached), is no jump
    short = dataclasses.replace(saved, warmup_steps=2, max_steps=4)
    assert lr_at(4, dataclasses.replace(short, max_steps=6)) == pytest.approx(lr_at(3, short))
    assert extension_refusal(short, dataclasses.replace(short, max_steps=6), 4) == ""
    assert extension_refusal(short, dataclasses.replace(short, max_steps=7), 4)
    # a higher peak in the warm-up is a jump too; the command named keeps the schedule
    line = extension_refusal(saved, dataclasses.replace(saved, lr=2.0), 5)
    assert "train.lr 1.0 -> 2.0 would raise the LR from 0.5 (step 5) to 1.2 at step 6" in line
    assert line.endswith("To train on without a jump: train.max_steps=100")


def test_a_smoke_test_inside_the_warm_up_extends_with_max_steps_alone():
    """A run shorter than its warm-up (a smoke test of a GPU preset) ends below the peak; extended, the warm-up goes
    on where the uninterrupted run's would, past the old max_steps."""
    for decay in DECAYS:
        saved = train_cfg(f"train.decay={decay}", "train.max_steps=4")
        longer = dataclasses.replace(saved, max_steps=100)
        assert lr_at(4, longer) > lr_at(3, saved)  # the warm-up's rise, as in the run of 100 steps
        assert extension_refusal(saved, longer, 4) == "" and train_longer(saved, 4) == "train.max_steps=8"
    assert "never decaying" in schedule_warning(train_cfg("train.decay=wsd", "train.max_steps=4"))  # a fraction: runs


def test_a_schedule_that_ends_at_its_peak_is_warned_about():
    assert "never decaying" in schedule_warning(train_cfg("train.max_steps=10"))
    assert schedule_warning(train_cfg("train.max_steps=11")) == ""
    assert schedule_warning(train_cfg("train.max_steps=5", "train.decay=constant")) == ""


def test_a_run_decayed_to_an_lr_of_zero_is_told_why_it_cannot_train_on():
    """A WSD run with ``min_lr_ratio`` 0 ends at LR 0: every LR to train on would be a jump, and ``train.lr=0`` is
    no valid config, so no command holding it is printed: the line says why and what to do instead."""
    from pretrain.config import load_config as load
    from pretrain.driver.resume_checks import check_steps_left
    from pretrain.train.schedule import decayed_out

    run = load(None, ["train.decay=wsd", "train.min_lr_ratio=0", "train.max_steps=40", "train.warmup_steps=4"])
    assert lr_at(39, run.train) == 0 and decayed_out(run.train, 20) == ""  # mid-run: trains on
    why = decayed_out(run.train, 40)
    assert why.startswith("the LR has decayed to 0 (train.min_lr_ratio=0)") and "anneal" in why
    with pytest.raises(ConfigError, match=r"there is nothing to train, and the LR has decayed to 0") as e:
        check_steps_left(run, run, 40, "CKPT")
    assert "train.lr=0" not in str(e.value)
    longer = dataclasses.replace(run.train, max_steps=80)
    refusal = extension_refusal(run.train, longer, 40)
    assert "The LR has decayed to 0" in refusal and "train.lr=0" not in refusal
    floor = dataclasses.replace(run.train, min_lr_ratio=0.1)  # a floor above 0: held, as before
    assert decayed_out(floor, 40) == "" and "train.lr=" in train_longer(floor, 40)
