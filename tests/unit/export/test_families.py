"""Hugging Face export: the pure key maps (rules) and the exact rewrites of pretrain/export/families.py, checked
on our own model's logits."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.export import families as fam
from pretrain.export.parity import our_model, parity_batch
from tests.unit.export.test_hf import D, one_thread, perturbed_state, tiny  # noqa: F401 - the autouse fixture is used by name

# ----------------------------------------------------------------------------------------------
# Pure key maps and exact rewrites
# ----------------------------------------------------------------------------------------------


def test_rules_roundtrip_and_strictness():
    cfg = tiny(norm="rmsnorm", activation="swiglu", num_kv_heads=2, tie_embeddings=False)
    sd = perturbed_state(cfg)
    hf_sd = fam.apply_rules(sd, fam.LLAMA.rules(cfg), cfg)
    assert "model.layers.1.self_attn.k_proj.weight" in hf_sd and len(hf_sd) == len(sd)
    back, consts = fam.invert_rules(hf_sd, fam.LLAMA.rules(cfg), cfg)
    assert not consts and back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="no place"):
        fam.apply_rules({**sd, "extra.weight": torch.zeros(1)}, fam.LLAMA.rules(cfg), cfg)
    with pytest.raises(ValueError, match="lacks"):
        fam.apply_rules({k: v for k, v in sd.items() if "q_proj" not in k}, fam.LLAMA.rules(cfg), cfg)


def test_gpt2_conv1d_fusion_is_transposed_concat():
    cfg = tiny(position="learned")
    sd, rcfg = fam.GPT2.rewrite(perturbed_state(cfg), cfg)
    hf_sd = fam.apply_rules(sd, fam.GPT2.rules(rcfg), rcfg)
    w = hf_sd["transformer.h.0.attn.c_attn.weight"]
    assert w.shape == (D, 3 * D)  # Conv1D: (in, out)
    assert torch.equal(w[:, D : 2 * D], sd["blocks.0.attn.k_proj.weight"].t())
    assert torch.equal(hf_sd["transformer.h.0.mlp.c_fc.weight"], sd["blocks.0.ffn.up_proj.weight"].t())
    assert "lm_head.bias" not in hf_sd and torch.all(hf_sd["transformer.h.0.attn.c_attn.bias"] == 0)


def _logits(cfg: ModelConfig, sd: dict, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return our_model(cfg, sd)(ids).logits


@pytest.mark.parametrize(
    "rewrite,cfg",
    [
        (fam.fill_zero_biases, tiny(position="learned")),
        (fam.expand_kv_heads, tiny(num_kv_heads=2, bias=True)),
        (fam.expand_kv_heads, tiny(num_kv_heads=1, norm="rmsnorm")),
        (
            fam.fold_deepnorm,
            tiny(
                kind="encoder",
                norm_placement="deepnorm",
                position="learned",
                embedding_norm=True,
                mlm_head_transform=True,
                bias=True,
            ),
        ),
        (
            fam.fold_deepnorm,
            tiny(
                kind="decoder",
                norm_placement="deepnorm",
                embedding_norm=True,
                tie_embeddings=False,
                norm="rmsnorm",
                activation="swiglu",
                num_layers=6,
            ),
        ),
    ],
    ids=["zero-biases", "gqa-2", "gqa-1", "deepnorm-encoder", "deepnorm-rms-untied"],
)
def test_rewrites_are_exact_on_our_model(rewrite, cfg):
    sd = perturbed_state(cfg)
    sd2, cfg2 = rewrite(sd, cfg)
    assert cfg2 != cfg
    ids = parity_batch(cfg)
    diff = (_logits(cfg, sd, ids) - _logits(cfg2, sd2, ids)).abs().max().item()
    print(f"\n{rewrite.__name__}: max |diff| = {diff:.2e}")
    assert diff < 1e-5


def test_fold_deepnorm_needs_the_stream_endpoints():
    with pytest.raises(ValueError, match="embedding_norm"):
        fam.fold_deepnorm({}, tiny(norm_placement="deepnorm"))


def test_a_decoder_trained_on_sep_separated_documents_ends_generation_at_sep(tokenizer, tmp_path):
    """A BERT-like tokenizer (sep, no eos) separates a decoder's documents with sep (``separator_id``): the export's
    config and generation config name it as the end of sequence, so ``generate`` stops there; an encoder keeps
    none (sep is not its end of generation)."""
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from pretrain.data.tokenizer import separator_id
    from pretrain.export.hf import export_model, special_token_ids

    d = tmp_path / "tok"
    tokenizer.save_pretrained(str(d))
    sep_only = PreTrainedTokenizerFast.from_pretrained(str(d), eos_token=None, sep_token="<|endoftext|>")
    assert sep_only.eos_token_id is None and sep_only.sep_token_id == separator_id(sep_only)
    assert special_token_ids(sep_only, "decoder")["eos_token_id"] == sep_only.sep_token_id
    assert special_token_ids(sep_only, "encoder")["eos_token_id"] is None
    cfg = tiny(dict(norm="rmsnorm", activation="swiglu", position="rotary"))
    export_model(cfg, perturbed_state(cfg), sep_only, tmp_path / "hf", log=lambda *a: None)
    assert GenerationConfig.from_pretrained(str(tmp_path / "hf")).eos_token_id == sep_only.sep_token_id
