"""The tokenizer (``pretrain/data/tokenizer.py``): trained deterministically, round-trips text, has its specials."""

from __future__ import annotations

import pytest

from pretrain.config import DataConfig, SourceConfig
from pretrain.data import load_or_train_tokenizer

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_tokenizer_deterministic_roundtrip_specials(corpus, tok, tmp_path):
    cfg = DataConfig(sources=[SourceConfig(path=str(corpus))], tokenizer_vocab_size=400, tokenizer_train_docs=1000)
    again = load_or_train_tokenizer(cfg)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert len(tok) == 400
    specials = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|pad|>", "<|mask|>", "<|unk|>")}
    assert tok.eos_token == tok.bos_token == "<|endoftext|>"
    assert (tok.pad_token, tok.mask_token, tok.unk_token) == ("<|pad|>", "<|mask|>", "<|unk|>")
    assert set(specials.values()) == set(tok.all_special_ids) and len(set(specials.values())) == 4
    for s in ["naïve café 東京 ☕🙂", "  leading and\ttabs\n\nand newlines  ", "Ünïcödé — “quotes” 𝔘 \u200b end"]:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.bos_token_id not in ids
        assert tok.decode(ids) == s
    # the saved directory loads through data.tokenizer
    saved = tmp_path / "saved"
    load_or_train_tokenizer(cfg, saved)
    loaded = load_or_train_tokenizer(DataConfig(tokenizer=str(saved)))
    assert loaded("déjà vu")["input_ids"] == tok("déjà vu")["input_ids"]
    with pytest.raises(ValueError, match="data.tokenizer"):
        load_or_train_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing")))


def test_a_tokenizer_without_a_document_separator_is_one_line():
    from types import SimpleNamespace

    import pytest

    from pretrain.config import ConfigError
    from pretrain.data.tokenizer import separator_id

    assert separator_id(SimpleNamespace(eos_token_id=None, sep_token_id=3)) == 3
    with pytest.raises(ConfigError, match="^the tokenizer has neither an eos nor a sep token to separate documents"):
        separator_id(SimpleNamespace(eos_token_id=None, sep_token_id=None))


def test_documents_are_encoded_whole_whatever_truncation_or_padding_a_tokenizer_file_saved(tok, tmp_path):
    """Some published tokenizers save truncation and padding in their tokenizer.json, which loading turns on again:
    a training document is still encoded whole and unpadded (the tokenizer the user gave is not changed)."""
    from transformers import PreTrainedTokenizerFast

    from pretrain.data.tokenizer import make_encoder

    tok.save_pretrained(str(tmp_path / "plain"))
    saved = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "plain"))
    saved.backend_tokenizer.enable_truncation(max_length=8)
    saved.backend_tokenizer.enable_padding(pad_id=tok.pad_token_id, pad_token="<|pad|>")
    saved.save_pretrained(str(tmp_path / "truncating"))
    loaded = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "truncating"))
    assert loaded.backend_tokenizer.truncation is not None and loaded.backend_tokenizer.padding is not None
    docs = ["A long document about the history of the harbour, its ships and the weather of the coast.", "short"]
    whole = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    assert len(whole[0]) > 8 and make_encoder(loaded)(docs) == whole == make_encoder(tok)(docs)
    assert loaded.backend_tokenizer.truncation is not None, "the given tokenizer is left as it was"
