"""Early-exit training in one process: the exit schedule and weights (pure), the config's checks, the model's
exit losses against the same model cut to E blocks, and the speed-up bound of an exit's acceptance. The
multi-worker run (ZeRO-3, resume, MLflow metrics) is in ``tests/integration/growth/test_layer_drop.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config import ConfigError, EarlyExitConfig
from pretrain.model import build_model
from pretrain.model.early_exit import active_exits, exit_depths, exit_weight, speedup_bound, validation_exits
from tests.harness import tiny_config

L = 6


def test_exit_depths_follow_the_depth():
    assert exit_depths(EarlyExitConfig(), L) == []
    assert exit_depths(EarlyExitConfig(layers="all"), L) == [1, 2, 3, 4, 5]
    assert exit_depths(EarlyExitConfig(layers="every:2"), L) == [2, 4]
    assert exit_depths(EarlyExitConfig(layers="every:2"), 12) == [2, 4, 6, 8, 10]  # a grown model: new exits join
    assert exit_depths(EarlyExitConfig(layers=[4, 1]), L) == [1, 4]
    assert validation_exits(EarlyExitConfig(layers="every:3", curriculum="rotational"), L) == [(3, 1.0)]


def test_weights_are_layerskips_normalized_scale_relative_to_the_final_layer():
    ee = EarlyExitConfig(layers="all", scale=0.5)
    e = [sum(range(1, d + 1)) for d in range(1, L + 1)]  # e(E) = 1 + ... + E
    normalized = [x / sum(e) for x in e]  # LayerSkip: every layer's weight over the sum, the final one's included
    for d in range(1, L):
        assert exit_weight(ee, d, L) == pytest.approx(0.5 * normalized[d - 1] / normalized[-1])
    assert exit_weight(ee, 1, L) < exit_weight(ee, 3, L) < exit_weight(ee, 5, L) < 0.5


def test_curricula_are_functions_of_the_step():
    none = EarlyExitConfig(layers="all")
    assert [d for d, _ in active_exits(none, L, 17, 100)] == [1, 2, 3, 4, 5]
    rot = dataclasses.replace(none, curriculum="rotational", rotation=2)
    seen = [[d for d, _ in active_exits(rot, L, t, 100)] for t in range(4)]
    assert seen == [[1, 3, 5], [2, 4], [1, 3, 5], [2, 4]]  # every exit once in every `rotation` steps
    rot3 = dataclasses.replace(rot, rotation=3)
    covered = sorted(d for t in range(3) for d, _ in active_exits(rot3, L, t, 100))
    assert covered == [1, 2, 3, 4, 5]
    grad = dataclasses.replace(none, curriculum="gradual", gradual_fraction=0.5)
    on = [[d for d, _ in active_exits(grad, L, t, 120)] for t in (0, 10, 20, 30, 40, 59, 60, 119)]
    assert on[0] == []  # the deepest exit (5) switches on at 0.5 * 120 * 2 / 6 = 20
    assert on[1] == [] and on[2] == [5] and on[3] == [4, 5] and on[4] == [3, 4, 5]
    assert on[5] == [2, 3, 4, 5] and on[6] == on[7] == [1, 2, 3, 4, 5]  # all on at half the run
    assert active_exits(grad, L, 30, 120) == active_exits(grad, L, 30, 120)  # no hidden state


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("layer_drop.early_exit.layers=most", "layer_drop.early_exit.layers: expected '', 'all', 'every:N'"),
        ("layer_drop.early_exit.layers=every:0", "layer_drop.early_exit.layers: expected"),
        ("layer_drop.early_exit.layers=[2,6]", "layer_drop.early_exit.layers: depths must be distinct and in 1..5"),
        ("layer_drop.early_exit.layers=[2,2]", "layer_drop.early_exit.layers: depths must be distinct"),
        ("layer_drop.early_exit.scale=0", "layer_drop.early_exit.scale: must be > 0"),
        ("layer_drop.early_exit.rotation=0", "layer_drop.early_exit.rotation: must be >= 1"),
        ("layer_drop.early_exit.gradual_fraction=1.5", "layer_drop.early_exit.gradual_fraction: must be in (0, 1]"),
        ("layer_drop.early_exit.curriculum=sometimes", "layer_drop.early_exit.curriculum: expected one of none"),
    ],
)
def test_bad_values_are_named_by_path(override, message):
    with pytest.raises(ConfigError, match=None) as err:
        tiny_config("model.num_layers=6", override)
    assert str(err.value).startswith(message), str(err.value)


def test_encoders_are_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        tiny_config("model.kind=encoder", "layer_drop.early_exit.layers=all")
    assert str(err.value).startswith("layer_drop.early_exit.layers: early-exit training is for decoders")
    assert "\n" not in str(err.value)


def _model_and_batch():
    cfg = tiny_config("model.num_layers=4", "model.dropout=0.0", "train.precision=fp32")
    model = build_model(cfg.model, seed=5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (3, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return model, ids, labels


def _cut(model, ids, labels, depth):
    """The model's output with only its first ``depth`` blocks (the shared final norm and head after them)."""
    return model(ids, labels=labels, layer_mask=[i < depth for i in range(len(model.blocks))])


def test_exit_losses_are_the_losses_of_the_model_cut_to_e_blocks_and_their_gradients_add_up():
    model, ids, labels = _model_and_batch()
    exits = [(3, 0.5), (1, 0.25)]  # any order: computed in depth order
    out = model(ids, labels=labels, exits=exits)
    cut = {d: _cut(model, ids, labels, d).loss for d in (1, 3)}
    torch.testing.assert_close(out.exit_losses, torch.stack([cut[1], cut[3]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.exit_loss, 0.25 * cut[1] + 0.5 * cut[3], rtol=0, atol=1e-6)
    assert out.exit_tokens is None  # training forwards keep no tokens
    plain = model(ids, labels=labels)
    assert torch.equal(out.loss, plain.loss)  # the main loss is untouched
    torch.testing.assert_close(out.objective(), plain.loss + out.exit_loss)

    out.objective().backward()  # the exits' heads are recomputed in the backward
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (plain.loss + 0.25 * cut[1] + 0.5 * cut[3]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_validation_forwards_give_each_exits_greedy_tokens():
    model, ids, labels = _model_and_batch()
    model.eval()
    with torch.no_grad():
        out = model(ids, labels=labels, exits=[(2, 1.0)])
        cut = _cut(model, ids, labels, 2)
    assert out.exit_tokens is not None and out.exit_tokens.shape == (1, 3, 16)
    assert torch.equal(out.exit_tokens[0], cut.logits.argmax(-1))
    torch.testing.assert_close(out.exit_losses[0], cut.loss, rtol=0, atol=1e-6)


def test_exits_need_labels_and_a_depth_inside_the_model():
    model, ids, labels = _model_and_batch()
    with pytest.raises(ValueError, match="exits"):
        model(ids, exits=[(1, 1.0)])
    with pytest.raises(ValueError, match=r"depths in 1\.\.3"):
        model(ids, labels=labels, exits=[(4, 1.0)])


def test_pruning_keeps_the_listed_exits_the_pruned_model_has():
    from pretrain.driver.prune import prune_blocks

    cfg = tiny_config("model.num_layers=6", "layer_drop.early_exit.layers=[1,3,5]")
    new, _ = prune_blocks(cfg, build_model(cfg.model, seed=1).state_dict(), [0, 2, 4])
    assert new.layer_drop.early_exit.layers == [1]
    new.validate()  # a valid child config


def test_the_speedup_bound_of_an_exit():
    """Rounds of k drafts at E/L of a forward each and one verifying forward, yielding the accepted prefix plus one
    token: always-accepted drafts from half the depth reach 1 + k over 1 + k/2; never-accepted drafts cost more than
    they give; the bound grows with the acceptance and falls with the exit's depth."""
    assert speedup_bound(1.0, 2, 4, max_draft=4) == {"speedup": pytest.approx(5 / 3), "draft_tokens": 4}
    assert speedup_bound(1.0, 1, 4, max_draft=8)["speedup"] == pytest.approx(9 / 3)
    none = speedup_bound(0.0, 1, 4)
    assert none == {"speedup": pytest.approx(1 / 1.25), "draft_tokens": 1}
    # 0.69 from half the depth (a trained 4-block model's exit 2): one draft a round, 1.69 / 1.5
    assert speedup_bound(0.69, 2, 4) == {"speedup": pytest.approx(1.69 / 1.5), "draft_tokens": 1}
    at = [speedup_bound(a, e, 4)["speedup"] for a, e in ((0.8, 1), (0.6, 1), (0.6, 2))]
    assert at[0] > at[1] > at[2]
    for bad in ((1.2, 1, 4), (0.5, 0, 4), (0.5, 4, 4)):
        with pytest.raises(ValueError):
            speedup_bound(*bad)
