"""Annealing a WSD run (``./launch.sh anneal``): the child's schedule and its argument checks. The command end to
end is in ``tests/integration/train/test_anneal.py``."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.driver.anneal import anneal, annealed_config
from pretrain.train.schedule import lr_at
from tests.harness import tiny_model

TINY = [
    *tiny_model(max_seq_len=32, vocab_size=None),
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=500",
    "data.num_streams=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "train.lr=1e-2",
    "train.min_lr_ratio=0.1",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_sequences=8",
    "checkpoint.every_steps=2",
    "cluster.num_workers=1",
    "cluster.use_ray=false",
    "stability.plot_at_end=false",
]


def test_annealed_schedule_decays_from_the_checkpoint_lr_to_the_floor():
    parent = load_config(None, TINY + ["train.decay=wsd", "train.max_steps=1000", "train.decay_steps=200"])
    child = annealed_config(parent, 400, 50, ["train.decay_shape=linear"])
    t = child.train
    assert (t.decay, t.max_steps, t.decay_steps, t.warmup_steps) == ("wsd", 450, 50, 0)
    lrs = [lr_at(s, t) for s in range(400, 450)]
    assert lrs[0] == pytest.approx(1e-2 - 0.9e-2 / 50) and lrs[-1] == pytest.approx(1e-3)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    # from a point of a cosine run: from the LR of the checkpoint's last step (49), to the same absolute floor
    cos = load_config(None, TINY + ["train.max_steps=100"])
    t = annealed_config(cos, 50, 10).train
    assert t.lr == pytest.approx(lr_at(49, cos.train)) and lr_at(59, t) == pytest.approx(1e-3)


def test_the_child_is_named_after_its_parent_unless_a_name_is_given():
    parent = load_config(None, [*TINY, "train.decay=wsd", "train.max_steps=100"])
    assert annealed_config(parent, 50, 10).name == f"{parent.name}-anneal50"
    assert annealed_config(parent, 50, 10, ["name=cooldown"]).name == "cooldown"


def test_what_anneal_sets_itself_is_refused_as_an_override_not_replaced():
    """The child's schedule is a decay over ``steps=N`` from the checkpoint's step: ``train.max_steps`` and the
    other fields it sets were replaced unseen; a length past int64 made a child whose config could not be read."""
    parent = load_config(None, [*TINY, "train.decay=wsd", "train.max_steps=100"])
    for given in ("train.max_steps=5000", "train.warmup_steps=50", "train.decay=cosine", "train={decay_steps: 7}"):
        with pytest.raises(ConfigError, match=r"^anneal: train\.\w+ cannot be given: the child's schedule is a decay"):
            annealed_config(parent, 50, 10, [given])
    assert annealed_config(parent, 50, 10, ["train.min_lr_ratio=0.05"]).train.max_steps == 60  # the floor: taken
    with pytest.raises(ConfigError, match=r"^anneal: steps=9223372036854775807: step 50 \+ .* is out of range"):
        annealed_config(parent, 50, 2**63 - 1)


def test_a_checkpoint_whose_lr_has_decayed_to_zero_is_refused_in_one_line():
    done = load_config(None, [*TINY, "train.decay=wsd", "train.min_lr_ratio=0", "train.max_steps=200"])
    with pytest.raises(ConfigError, match=r"^anneal: the parent's LR at step 200 is 0 .* step=S$"):
        annealed_config(done, 200, 50)
    assert annealed_config(done, 150, 50).train.lr > 0  # a checkpoint before the decay's end anneals


@pytest.mark.parametrize(
    "args, message",
    [
        (["steps=5"], "give a run id or a checkpoint directory first"),
        (["RUN"], "steps=N (the length of the decay, > 0) is required"),
        (["RUN", "steps=0"], "steps=N (the length of the decay, > 0) is required"),
        (["RUN", "steps=5", "depth=2x"], "anneal: unknown option(s) ['depth']"),
        # a section given whole, a top-level key: config overrides, as train takes them (the parent is read next)
        (["/no/such", "steps=5", "data={val_holdout: 0.05}", "name=x"], "/no/such: no such checkpoint or run"),
        (["RUN", "steps=5", "step=x"], "anneal: step=x: not a checkpoint step"),
        (["RUN", "steps=5", "steps=50"], "anneal: steps given more than once"),
    ],
)
def test_bad_anneal_arguments_are_one_line(args, message):
    with pytest.raises(ConfigError) as e:
        anneal(args)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_only_a_change_of_the_training_streams_starts_fresh_streams():
    """The data position is a position in the streams: a new mixture starts fresh ones; a policy change (bad records,
    masking, the cache) keeps the parent's position."""
    from pretrain.driver.anneal import _stream

    parent = load_config(None, TINY + ["train.decay=wsd", "train.max_steps=1000", "train.decay_steps=200"])
    kept = annealed_config(parent, 400, 50, ["data.bad_records=fail", "data.mlm_probability=0.2"])
    assert _stream(kept) == _stream(parent)
    moved = annealed_config(parent, 400, 50, ["data.sources=[{path: demo, weight: 2}]"])
    assert _stream(moved) != _stream(parent)
