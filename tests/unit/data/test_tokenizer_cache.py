"""A first step in seconds: the tokenizer cache (trained once per corpus and settings, reused, rebuilt when
damaged). ``train --dry-run`` and the imports of a fresh command are in ``tests/integration/cli/test_startup.py``."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from pretrain.config import DataConfig, SourceConfig
from pretrain.data.tokenizer import TRAINER_SETTINGS
from pretrain.data.tokenizer_cache import cache_key, lookup, run_tokenizer
from tests.unit.data.common import make_docs, write_txt

SAMPLE = "The tokenizer of an unchanged corpus is trained once — naïve café 東京 ☕"


def small_cfg(corpus: Path, **kw) -> DataConfig:
    return DataConfig(
        sources=[SourceConfig(path=str(corpus))],
        tokenizer_vocab_size=400,
        tokenizer_train_docs=800,
        val_holdout=0.02,
        **kw,
    )


def tokenize(tok_dir: Path) -> tuple[dict, list[int]]:
    tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    return tok.get_vocab(), tok(SAMPLE, add_special_tokens=False)["input_ids"]


def test_cache_hit_gives_the_same_tokenizer_changes_miss_damage_is_rebuilt(tmp_path, cache):
    corpus = write_txt(tmp_path / "c.txt", make_docs(1200, "doc"))
    cfg = small_cfg(corpus)
    said: list[str] = []
    assert run_tokenizer(cfg, tmp_path / "a", said.append) == 400
    assert len(said) == 1 and said[0].startswith("tokenizer: trained (400 tokens), cached in ")
    entry = cache / "tokenizers" / cache_key(cfg, TRAINER_SETTINGS)
    assert entry.is_dir() and lookup(entry.name) == (entry, 400)

    said.clear()
    assert run_tokenizer(cfg, tmp_path / "b", said.append) == 400  # hit: copied, same vocab and ids
    assert said == [f"tokenizer: reused from cache {entry}"]
    assert tokenize(tmp_path / "b") == tokenize(tmp_path / "a")
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (tmp_path / "a" / "tokenizer.json").read_bytes()

    # any setting the tokenizer depends on, or the corpus, gives another key
    keys = {cache_key(cfg, TRAINER_SETTINGS)}
    for changed in (
        small_cfg(corpus, bad_records="fail"),
        DataConfig(**{**vars(cfg), "tokenizer_vocab_size": 420}),
        DataConfig(**{**vars(cfg), "tokenizer_train_docs": 700}),
        DataConfig(**{**vars(cfg), "val_holdout": 0.05}),
    ):
        keys.add(cache_key(changed, TRAINER_SETTINGS))
    keys.add(cache_key(cfg, {**TRAINER_SETTINGS, "min_frequency": 3}))
    assert len(keys) == 6
    with corpus.open("a") as f:
        f.write("one more document at the end of the corpus, which the tokenizer may now see\n")
    said.clear()
    run_tokenizer(cfg, tmp_path / "c", said.append)
    assert said[0].startswith("tokenizer: trained")

    # a damaged entry is ignored and rebuilt
    corpus.write_text(corpus.read_text().rsplit("one more", 1)[0])
    os.utime(corpus, ns=(0, 0))  # another identity than the first version; the same text
    key = cache_key(cfg, TRAINER_SETTINGS)
    run_tokenizer(cfg, tmp_path / "d", said.append)
    damaged = cache / "tokenizers" / key / "tokenizer.json"
    damaged.write_text(damaged.read_text()[:1000])
    assert lookup(key) is None
    said.clear()
    assert run_tokenizer(cfg, tmp_path / "e", said.append) == 400
    assert said[0].startswith("tokenizer: trained") and lookup(key) is not None
    assert tokenize(tmp_path / "e") == tokenize(tmp_path / "a")
    (cache / "tokenizers" / key / "meta.json").write_text("{")  # a partial meta.json: a miss too
    assert lookup(key) is None
    assert not [p for p in (cache / "tokenizers").iterdir() if p.name.startswith(".")]  # no leftovers


def test_cache_can_be_disabled_and_hub_sources_are_not_cached(tmp_path, cache, monkeypatch):
    corpus = write_txt(tmp_path / "c.txt", make_docs(600, "doc"))
    monkeypatch.setenv("PRETRAIN_TOKENIZER_CACHE", "0")
    said: list[str] = []
    run_tokenizer(small_cfg(corpus), tmp_path / "a", said.append)
    assert said == [] and not cache.exists()
    assert cache_key(DataConfig(sources=[SourceConfig(path="someone/dataset", format="hub")]), TRAINER_SETTINGS) is None


def test_demo_corpus_identity_is_its_content(tmp_path, cache):
    """The generated demo corpus has the same key from any working directory (data.cache_dir)."""
    one = DataConfig(cache_dir=str(tmp_path / "one"))
    two = DataConfig(cache_dir=str(tmp_path / "two"))
    assert cache_key(one, TRAINER_SETTINGS) == cache_key(two, TRAINER_SETTINGS)
    assert cache_key(one, TRAINER_SETTINGS) != cache_key(
        DataConfig(**{**vars(one), "tokenizer_vocab_size": 999}), TRAINER_SETTINGS
    )
