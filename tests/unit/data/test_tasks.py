"""Downstream tasks (``pretrain/data/tasks.py``): the built-in ``heldout_lastword`` task from held-out text."""

from __future__ import annotations

import pytest

from pretrain.config import DataConfig, SourceConfig
from pretrain.data.tasks import BUILTIN, load_tasks
from tests.unit.data.shards.common import build_shards

pytestmark = pytest.mark.usefixtures("datasets_cache")


def _examples(cfg: DataConfig) -> list:
    (task,) = load_tasks([BUILTIN], cfg, max_examples=20, num_choices=4, seed=3)
    return task.examples


def test_heldout_lastword_of_token_shards_is_the_task_of_their_text(tmp_path, corpus, tok):
    """Shard documents are tokens: decoded with the shards' tokenizer, they give the examples their text gives."""
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(str(tok_dir))
    shards = tmp_path / "shards"
    build_shards(shards, [corpus], tok, tok_dir)
    text = _examples(DataConfig(sources=[SourceConfig(path=str(corpus))], val_holdout=0.2))
    assert len(text) == 20
    assert _examples(DataConfig(sources=[SourceConfig(path=str(shards))], val_holdout=0.2)) == text

    def val_on(path) -> DataConfig:
        return DataConfig(sources=[SourceConfig(path=str(corpus))], val_sources=[SourceConfig(path=str(path))])

    assert _examples(val_on(shards)) == _examples(val_on(corpus))  # data.val_sources of token shards too


def test_a_task_file_that_is_not_text_and_held_out_text_too_short_are_one_line(tmp_path):
    from pretrain.config import ConfigError
    from pretrain.data.tasks import heldout_lastword, load_jsonl_task

    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"context": "a", "choices": ["b", "c"], "answer": 0}\n\xff\xfe\n')
    with pytest.raises(ConfigError, match=rf"^eval.tasks: {path}:2: not UTF-8 text \(byte 0xff\)$"):
        load_jsonl_task(path, 10)
    with pytest.raises(ConfigError, match=r"^eval.tasks: heldout_lastword: the held-out text has too few sentences"):
        heldout_lastword(["Too short.", "Also short here."], 10, 4, 0)


def test_the_held_out_documents_of_a_mixture_are_read_once_each(tmp_path, corpus):
    """A mixture's pass reads its smaller source again until the largest ends: the held-out documents the task is
    built from are each taken once, as validation takes them."""
    from pretrain.data.tasks import heldout_documents

    small = tmp_path / "small.txt"
    small.write_text("".join(f"A short held-out sentence number {i} about the sea.\n" for i in range(40)))
    cfg = DataConfig(sources=[SourceConfig(path=str(corpus)), SourceConfig(path=str(small))], val_holdout=0.2)
    docs = list(heldout_documents(cfg, seed=3))
    assert len(docs) == len(set(docs)) and any("held-out sentence" in d for d in docs)


def test_a_decoder_scores_every_token_of_a_choice_after_an_empty_context(tok):
    """A task of minimal pairs (empty context, whole sentences as choices): the first token of a choice is scored
    too, predicted from the document separator before it (a decoder predicts each token from the one before)."""
    from pretrain.data.tasks import Example, choice_rows

    example = Example("", ["The river flows into the sea.", "The river flow into the sea."], 0)
    for choice, rows in zip(example.choices, choice_rows(example, tok, "decoder", 64)):
        ((row,),) = [rows]
        scored = row["labels"][0, 1:]  # (the scorer predicts positions 1..T-1)
        assert scored[scored != -100].tolist() == tok(choice, add_special_tokens=False)["input_ids"]
        assert row["input_ids"][0, 0].item() == tok.eos_token_id
