"""What a resume may change (``pretrain/driver/resume_checks.py``), here for the output layer's bias; the checks
through the CLI are in ``tests/integration/checkpoint/test_resume_guard.py``."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.driver.resume_checks import check_resume


def test_the_lm_head_bias_is_compared_as_it_shapes_the_model():
    """``model.lm_head_bias`` null follows ``bias``: writing out the value it already had changes nothing; a head
    bias taken away is refused with an override that loads."""
    plain = load_config(None, [])  # bias false, lm_head_bias null: no head bias
    check_resume(plain, load_config(None, ["model.lm_head_bias=false"]), 4, "CKPT")
    old_gpt = load_config(None, ["model.bias=true"])  # a head bias, as gpt-125m had before lm_head_bias
    with pytest.raises(ConfigError) as e:
        check_resume(old_gpt, load_config(None, ["model.bias=true", "model.lm_head_bias=false"]), 4, "CKPT")
    assert str(e.value).startswith("model.lm_head_bias cannot change at resume (checkpoint True, asked False)")
    assert str(e.value).endswith("resume with model.lm_head_bias=true")
    load_config(None, ["model.bias=true", "model.lm_head_bias=true"])  # the override it names loads


def test_a_selection_bias_added_or_taken_away_at_resume_is_refused():
    """``moe.balance`` between ``aux_loss`` (no selection bias) and ``bias``/``both`` (a bias buffer in every MoE
    layer) changes what the checkpoint must hold: refused in one line (the strict load then failed on the missing
    or unexpected ``selection_bias``); between ``bias`` and ``both`` it is a change of loss only."""
    moe = ["moe.num_experts=4"]
    aux, bias, both = (load_config(None, [*moe, f"moe.balance={b}"]) for b in ("aux_loss", "bias", "both"))
    check_resume(bias, both, 4, "CKPT")
    check_resume(both, bias, 4, "CKPT")
    with pytest.raises(ConfigError, match=r"^moe.balance cannot change from aux_loss to bias at resume: the check"):
        check_resume(aux, bias, 4, "CKPT")
    with pytest.raises(
        ConfigError, match=r"selection biases would be dropped; resume with moe.balance=both \(or bias\)$"
    ):
        check_resume(both, aux, 4, "CKPT")
