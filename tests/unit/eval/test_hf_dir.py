"""Which directories ``eval`` and ``generate`` open as Hugging Face directories. Their refusals of damaged exports
are in ``test_evaluate.py`` (``test_bad_arguments_and_a_damaged_export_are_one_line``)."""

from __future__ import annotations

import pytest

from eval.evaluate import evaluate
from eval.generator import load_generator
from eval.hf_dir import is_hf_dir
from pretrain.config import ConfigError
from pretrain.export.hf import export_model
from tests.unit.export.test_hf import NAMED, one_thread, perturbed_state  # noqa: F401 - the autouse fixture


def test_an_export_without_its_config_is_diagnosed(tokenizer, tmp_path):
    """An export whose config.json is gone is still opened as an export: the refusal names the missing file and
    says to export again (not "no committed checkpoint")."""
    cfg, _ = NAMED["llama-tied-mha"]
    hf = tmp_path / "hf"
    export_model(cfg, perturbed_state(cfg), tokenizer, hf, log=lambda *a: None)
    (hf / "config.json").unlink()
    assert is_hf_dir(hf) and not is_hf_dir(tmp_path)
    for who, open_it in [("eval", evaluate), ("generate", load_generator)]:
        with pytest.raises(ConfigError) as e:
            open_it(str(hf))
        assert str(e.value).startswith(f"{who}: {hf}: config.json is missing; export it again (")
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("architectures", 5, "architectures must be a list of class names, got 5"),
        ("num_hidden_layers", "x", "num_hidden_layers"),
    ],
)
def test_a_config_with_a_bad_field_is_one_line(tokenizer, tmp_path, field, value, said):
    """A config.json that transformers' config class rejects (its own error types) is refused in one line that
    names the field, by both commands, not a traceback."""
    import json

    cfg, _ = NAMED["llama-tied-mha"]
    hf = tmp_path / "hf"
    export_model(cfg, perturbed_state(cfg), tokenizer, hf, log=lambda *a: None)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, field: value}))
    for who, open_it in [("eval", evaluate), ("generate", load_generator)]:
        with pytest.raises(ConfigError) as e:
            open_it(str(hf))
        assert str(e.value).startswith(f"{who}: ") and said in str(e.value) and "\n" not in str(e.value), e.value


def test_a_hub_style_bert_with_weights_its_class_does_not_use_opens_but_our_export_must_be_exact(tokenizer, tmp_path):
    """A hub BERT is saved from BertForPreTraining (pooler, next-sentence head) and names BertForMaskedLM: it opens
    as transformers loads it. The same extra weight in an export of ours is damage: refused."""
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from eval.hf_dir import open_hf_dir

    d = tmp_path / "bert"
    bert = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    transformers.BertForPreTraining(bert).save_pretrained(str(d))
    tokenizer.save_pretrained(str(d))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    hf = open_hf_dir(d, "eval")
    assert hf.kind == "encoder" and type(hf.model).__name__ == "BertForMaskedLM"
    cfg, _ = NAMED["llama-tied-mha"]
    ours = tmp_path / "ours"
    export_model(cfg, perturbed_state(cfg), tokenizer, ours, log=lambda *a: None)
    weights = ours / "model.safetensors"
    save_file({**load_file(str(weights)), "extra.weight": torch.zeros(2)}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="unexpected_keys"):
        open_hf_dir(ours, "eval")
