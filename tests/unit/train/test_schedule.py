"""LR schedules as pure functions of the step: warm-up, cosine/linear/constant and warmup-stable-decay."""

from __future__ import annotations

import math

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.train.schedule import lr_at, wsd_decay_steps


def train_cfg(*overrides):
    return load_config(
        None, ["train.lr=1.0", "train.min_lr_ratio=0.1", "train.max_steps=100", "train.warmup_steps=10", *overrides]
    ).train


def test_cosine_is_unchanged():
    t = train_cfg()
    assert lr_at(0, t) == pytest.approx(0.1) and lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))


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


@pytest.mark.parametrize("value, mode", [("true", "full"), ("false", "none"), ("selective", "selective")])
def test_activation_checkpointing_booleans_still_work(value, mode):
    assert train_cfg(f"train.activation_checkpointing={value}").activation_checkpointing == mode


# -- extending a run: the LR never rises across a resume ----------------------------------------------------------


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant", "wsd"])
@pytest.mark.parametrize("step", [5, 10, 50, 85, 100])
def test_the_overrides_a_summary_prints_never_raise_the_lr(decay, step):
    import dataclasses

    from pretrain.train.schedule import continue_overrides, raises_lr

    saved = train_cfg(f"train.decay={decay}")
    longer = continue_overrides(saved, step, 2 * step)
    resumed = load_config(None, [f"train.{k}={v}" for k, v in _train_items(saved)] + longer).train
    assert not raises_lr(saved, resumed, step), longer
    assert resumed.max_steps == 2 * step
    # a longer constant schedule, or WSD still at its peak, keeps the schedule: max_steps alone
    if decay == "constant" or (decay == "wsd" and step <= 80):
        assert longer == [f"train.max_steps={2 * step}"]
    assert raises_lr(saved, dataclasses.replace(saved, max_steps=2 * step), step) == (len(longer) > 1)


def _train_items(t):
    keys = ("lr", "min_lr_ratio", "max_steps", "warmup_steps", "decay")
    return [(k, getattr(t, k)) for k in keys]


def test_a_longer_cosine_run_is_refused_in_one_line_naming_what_to_use():
    import dataclasses

    from pretrain.train.schedule import extension_refusal

    saved = train_cfg()
    line = extension_refusal(saved, dataclasses.replace(saved, max_steps=200), 100)
    assert "\n" not in line and "train.max_steps 100 -> 200 would raise the LR from 0.1 (step 100)" in line
    assert "train.decay=constant train.lr=0.1" in line and "train.decay=wsd" in line and "anneal" in line
    assert extension_refusal(saved, dataclasses.replace(saved, max_steps=200), 5) == ""  # in warm-up: same LR
    assert extension_refusal(saved, dataclasses.replace(saved, max_steps=50), 40) == ""  # shorter: LR goes down
    assert extension_refusal(saved, dataclasses.replace(saved, lr=2.0), 60)  # a higher peak mid-decay: a jump


def test_a_schedule_that_ends_at_its_peak_is_warned_about():
    from pretrain.train.schedule import schedule_warning

    assert "never decaying" in schedule_warning(train_cfg("train.max_steps=10"))
    assert schedule_warning(train_cfg("train.max_steps=11")) == ""
    assert schedule_warning(train_cfg("train.max_steps=5", "train.decay=constant")) == ""
