"""Export of Mixture-of-Experts models (``pretrain/export/moe.py`` through ``export_model``): Mixtral or Qwen3-MoE
where exact, the self-contained remote-code model otherwise. The export of an expert-parallel checkpoint is an
integration test."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import ModelConfig, MoEConfig
from pretrain.model import build_model
from pretrain.model.moe import moe_layers


def _perturbed(cfg, moe, seed=0):
    model = build_model(cfg, seed, moe)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for _, layer in moe_layers(model):
            if layer.selection_bias is not None:  # large enough to change the chosen experts
                layer.selection_bias.copy_(torch.randn(layer.num_experts, generator=g) * 0.3)
    return model.state_dict()


MIXTRAL_LIKE = dict(
    kind="decoder",
    vocab_size=300,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    max_seq_len=32,
    activation="swiglu",
    norm="rmsnorm",
    norm_placement="pre",
    position="rotary",
    tie_embeddings=False,
)


@pytest.mark.parametrize(
    "model_kw,moe_kw,expected",
    [
        (MIXTRAL_LIKE, dict(num_experts=4, top_k=2), "MixtralForCausalLM"),
        (MIXTRAL_LIKE, dict(num_experts=4, top_k=1), "PretrainTransformerForCausalLM"),  # top-1: Switch's weight p
        (MIXTRAL_LIKE, dict(num_experts=4, top_k=2, every=2), "PretrainTransformerForCausalLM"),
        (MIXTRAL_LIKE, dict(num_experts=4, top_k=2, normalize_top_k=False), "PretrainTransformerForCausalLM"),
        (MIXTRAL_LIKE, dict(num_experts=4, top_k=2, balance="bias"), "PretrainTransformerForCausalLM"),
        ({**MIXTRAL_LIKE, "qk_norm": True}, dict(num_experts=4, top_k=2, every=2), "Qwen3MoeForCausalLM"),
        (
            {**MIXTRAL_LIKE, "qk_norm": True, "num_layers": 3},
            dict(num_experts=4, top_k=2, layers=[0, 2], normalize_top_k=False),
            "Qwen3MoeForCausalLM",
        ),
        (
            {**MIXTRAL_LIKE, "qk_norm": True, "tie_embeddings": True},
            dict(num_experts=4, top_k=1),
            "Qwen3MoeForCausalLM",
        ),
        (
            dict(
                kind="encoder",
                vocab_size=300,
                hidden_size=32,
                num_layers=2,
                num_heads=4,
                max_seq_len=32,
                activation="gelu",
                norm="layernorm",
                norm_placement="post",
                position="learned",
                bias=True,
                embedding_norm=True,
                mlm_head_transform=True,
            ),
            dict(num_experts=4, top_k=2, ffn_size=48),
            "PretrainTransformerForMaskedLM",
        ),
    ],
)
def test_moe_export_parity(model_kw, moe_kw, expected, tmp_path):
    """Mixtral or Qwen3-MoE when exact, else the self-contained remote-code model (encoders have no HF MoE class);
    the export re-checks logits parity, and a fresh load agrees with our model on another batch."""
    from transformers import PreTrainedTokenizerFast

    from pretrain.data.tokenizer import train_tokenizer
    from pretrain.export.hf import export_model, load_exported
    from pretrain.export.parity import logits_max_abs_diff, our_model, parity_batch

    cfg, moe = ModelConfig(**model_kw), MoEConfig(**moe_kw)
    tok_dir = tmp_path / "tok"
    train_tokenizer([f"the {i} cat sat on the mat {i * 7}" for i in range(300)], 300).save_pretrained(str(tok_dir))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    sd = _perturbed(cfg, moe)
    report = export_model(cfg, sd, tokenizer, tmp_path / "hf", log=lambda *a: None, moe=moe)
    assert report.hf_class == expected and report.max_abs_diff < 1e-5
    loaded = load_exported(tmp_path / "hf", cfg.kind)
    assert type(loaded).__name__ == expected
    diff = logits_max_abs_diff(our_model(cfg, sd, moe), loaded, parity_batch(cfg, seed=7))
    qk = ", qk_norm" if cfg.qk_norm else ""
    print(f"\n{expected} ({moe_kw}{qk}): max |logits diff| {report.max_abs_diff:.2e} / {diff:.2e}")
    assert diff < 1e-5


def test_moe_export_refuses_what_no_target_represents():
    from pretrain.export.hf import export_target

    enc = ModelConfig(kind="encoder", vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, qk_norm=True)
    hf_class, reason = export_target(enc, MoEConfig(num_experts=4))
    assert hf_class is None and reason.startswith("cannot export: model.qk_norm")
    hf_class, reason = export_target(ModelConfig(**MIXTRAL_LIKE), MoEConfig(num_experts=4, every=2))
    assert hf_class is None and "trust_remote_code=True" in reason and "MixtralForCausalLM: blocks [0]" in reason


def test_the_exported_balance_coefficient_is_as_strong_as_the_runs():
    """Ours is 1.0 per MoE layer at balance, summed over the layers; transformers' ``load_balancing_loss_func``
    pools the layers into one loss that is ``top_k`` at balance: the exported ``router_aux_loss_coef`` times it
    equals the run's weight times its MoE layers."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from pretrain.export.moe import to_hf_moe

    cfg, moe = ModelConfig(**{**MIXTRAL_LIKE, "num_layers": 3}), MoEConfig(num_experts=4, top_k=2, aux_loss_weight=0.02)
    target, hf_config, _ = to_hf_moe(build_model(cfg, 0, moe).state_dict(), cfg, moe, {})
    assert target == "MixtralForCausalLM"
    logits = torch.zeros(3 * 8, 4)  # every layer's 8 tokens, balanced: mean router probability 1/E each
    balanced = load_balancing_loss_func((logits[:8], logits[8:16], logits[16:]), 4, 2)
    assert float(balanced) == pytest.approx(2.0)  # top_k
    assert hf_config["router_aux_loss_coef"] * float(balanced) == pytest.approx(0.02 * 3)
