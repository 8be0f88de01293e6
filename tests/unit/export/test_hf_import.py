"""Importing Hugging Face models (``pretrain/export/hf_import.py``): export -> import -> export is bitwise, models
that ``transformers`` builds itself import with logits parity, and a model no family maps exactly is refused."""

from __future__ import annotations

import json

import pytest
import torch

from pretrain.config import ModelConfig
from pretrain.export.hf import export_model, export_target, import_hf
from pretrain.export.parity import logits_max_abs_diff, our_model, parity_batch
from tests.unit.export.test_hf import (  # noqa: F401 - the autouse fixture is used by name
    NAMED,
    D,
    L,
    T,
    V,
    one_thread,
    perturbed_state,
    safetensors_of,
)


@pytest.mark.parametrize(
    "name",
    [
        "llama-untied-gqa",
        "llama-tied-mha",
        "gpt2-untied-gqa",
        "gpt2-biases-but-the-heads",
        "bert-tied",
        "bert-untied-nobias-gqa",
        "bert-deepnorm",
        "remote-gpt2-with-bias",
        "remote-prenorm-rotary-encoder",
    ],
)
def test_export_import_export_is_bitwise(name, tokenizer, tmp_path):
    cfg, _ = NAMED[name]
    sd = perturbed_state(cfg)
    export_model(cfg, sd, tokenizer, tmp_path / "a", log=lambda *a: None)
    fields, sd2 = import_hf(tmp_path / "a")
    cfg2 = ModelConfig(**fields)
    if not any(s in name for s in ("gqa", "deepnorm")):  # those rewrites are exact but not invertible
        assert sd2.keys() == {k for k in sd}
        assert all(torch.equal(sd2[k], sd[k]) for k in sd), "import must give back our weights bitwise"
    export_model(cfg2, sd2, tokenizer, tmp_path / "b", log=lambda *a: None)
    a, b = safetensors_of(tmp_path / "a"), safetensors_of(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        json.loads((tmp_path / "a" / "config.json").read_text())["architectures"]
        == json.loads((tmp_path / "b" / "config.json").read_text())["architectures"]
    )


def test_import_hf_models_built_from_configs(tmp_path):
    """HF models made by transformers itself (not by our exporter) import with logits parity."""
    import transformers

    cases = [
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=V,
                hidden_size=D,
                intermediate_size=64,
                num_hidden_layers=L,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=T,
                tie_word_embeddings=False,
            )
        ),
        # Real BERT layout: 2 token types (type 0 is folded into positions), biases everywhere.
        transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=V,
                hidden_size=D,
                num_hidden_layers=L,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=T,
                type_vocab_size=2,
            )
        ),
        transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=V, n_embd=D, n_layer=L, n_head=4, n_positions=T, activation_function="gelu"
            )
        ),
    ]
    for i, model in enumerate(cases):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.save_pretrained(str(tmp_path / f"m{i}"))
        fields, sd = import_hf(tmp_path / f"m{i}")
        cfg = ModelConfig(**fields)
        diff = logits_max_abs_diff(our_model(cfg, sd), model.eval(), parity_batch(cfg))
        print(f"\nimport {type(model).__name__}: max |logits diff| = {diff:.2e}")
        assert diff <= 1e-4
        # what was imported exports to its own class again (GPT-2: biases everywhere but the LM head)
        assert export_target(cfg)[0] == type(model).__name__, export_target(cfg)
    # A shorter max_seq_len keeps the first rows of a learned table.
    fields, sd = import_hf(tmp_path / "m1", max_seq_len=8)
    assert fields["max_seq_len"] == 8 and sd["embed_positions.weight"].shape[0] == 8


def test_import_refuses_inexact(tmp_path):
    import transformers

    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, n_positions=T)
    ).save_pretrained(str(tmp_path / "gelu_new"))
    with pytest.raises(ValueError, match="activation_function='gelu_new'"):
        import_hf(tmp_path / "gelu_new")
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=V,
            hidden_size=D,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        )
    ).save_pretrained(str(tmp_path / "scaled"))
    with pytest.raises(ValueError, match="rope type 'linear'"):
        import_hf(tmp_path / "scaled")
    with pytest.raises(ValueError, match="no config.json"):
        import_hf(tmp_path)


def test_init_from_hf_keeps_the_runs_training_choices(tokenizer, tmp_path):
    """``model.init_from_hf`` takes the architecture of the directory and keeps what the run chose for training: the
    dropouts, the init std and the z-loss (a loss weight, not architecture)."""
    import dataclasses

    from pretrain.export.hf_import import model_config_from_hf

    cfg, _ = NAMED["llama-untied-gqa"]
    export_model(cfg, perturbed_state(cfg), tokenizer, tmp_path / "a", log=lambda *a: None)
    choices = {"dropout": 0.1, "attention_dropout": 0.05, "init_std": 0.01, "z_loss": 1e-4}
    base = dataclasses.replace(ModelConfig(), num_layers=7, **choices)
    got, _ = model_config_from_hf(tmp_path / "a", base=base)
    assert {k: getattr(got, k) for k in choices} == choices and got.num_layers == cfg.num_layers
