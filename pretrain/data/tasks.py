"""Downstream tasks (``eval.tasks``): multiple-choice and cloze examples, from local JSONL files or built from
the run's own held-out text, turned into scoring rows for the one scorer (:mod:`pretrain.model.score`).

File format (docs/tasks.md), one example per line::

    {"context": "The capital of France is", "choices": [" Paris", " Rome", " Oslo"], "answer": 0}

``type`` (optional): ``multiple_choice`` (default: ``acc`` and ``acc_norm``) or ``cloze`` (``acc`` only: the
choices are candidate last words). The built-in task ``heldout_lastword`` is a cloze task: the last word of
held-out sentences against distractor words drawn deterministically from the held-out vocabulary.

Rows (:func:`choice_rows`): decoders — one row per choice, ``context + choice`` tokens with labels on the choice
tokens only, so the scorer's summed nats are minus the choice's log-likelihood (lm-evaluation-harness);
encoders — one row per choice token, that token replaced by the mask token and the only label, so the summed
nats over a choice's rows are minus its masked-LM pseudo-log-likelihood.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.config import ConfigError, DataConfig
from pretrain.config.errors import clip
from pretrain.data.packing import IGNORE_INDEX
from pretrain.data.tokenizer import mask_id, separator_id

BUILTIN = "heldout_lastword"
_WORD = re.compile(r"[A-Za-z]{3,}")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class Example:
    context: str
    choices: list[str]
    answer: int


@dataclass
class Task:
    name: str
    examples: list[Example]
    cloze: bool = False
    """Cloze tasks log ``acc`` only (their choices are single words: no length normalization)."""


def task_name(spec: str) -> str:
    return BUILTIN if spec == BUILTIN else Path(spec).stem


def load_jsonl_task(path: str | Path, max_examples: int) -> Task:
    """The first ``max_examples`` examples of a task file (one-line :class:`ConfigError` naming the line)."""
    path = Path(path)
    examples, types = [], set()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"eval.tasks: {path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ex = Example(str(rec["context"]), [str(c) for c in rec["choices"]], int(rec["answer"]))
            except (ValueError, KeyError, TypeError) as e:
                why = clip(e)  # a value error may quote the value
                raise ConfigError(f"eval.tasks: {path}:{n}: expected {{context, choices, answer}} ({why})") from None
            if len(ex.choices) < 2 or not 0 <= ex.answer < len(ex.choices):
                raise ConfigError(f"eval.tasks: {path}:{n}: need >= 2 choices and 0 <= answer < len(choices)")
            types.add(rec.get("type", "multiple_choice"))
            examples.append(ex)
            if len(examples) == max_examples:
                break
    if not examples:
        raise ConfigError(f"eval.tasks: {path}: no examples")
    return Task(path.stem, examples, cloze=types == {"cloze"})


def heldout_lastword(documents, max_examples: int, num_choices: int, seed: int, min_docs: int = 200) -> Task:
    """The built-in cloze task from held-out ``documents`` (an iterable of texts): for each sentence of at least
    six words ending in an alphabetic word, the context is the sentence without that word and the choices are
    the word and ``num_choices - 1`` other words of the held-out text (seeded per example: deterministic).
    Reads documents until it has ``max_examples`` examples and a vocabulary from at least ``min_docs`` documents."""
    pairs: list[tuple[str, str]] = []
    vocab: set[str] = set()
    for i, doc in enumerate(documents):
        if len(pairs) >= max_examples and i >= min_docs:
            break
        for sentence in _SENTENCE_END.split(doc):
            words = sentence.strip().rstrip(".!?").split()
            vocab.update(w for w in words if _WORD.fullmatch(w))
            if len(words) >= 6 and _WORD.fullmatch(words[-1]) and len(pairs) < max_examples:
                pairs.append((" ".join(words[:-1]), words[-1]))
    pool = sorted(vocab)
    if len(pairs) == 0 or len(pool) < num_choices:
        raise ConfigError(
            f"eval.tasks: heldout_lastword: the held-out text has too few sentences (of 6 words or more: "
            f"{len(pairs)}) or words ({len(pool)}; {num_choices} choices need as many)"
        )
    examples = []
    for k, (context, word) in enumerate(pairs):
        rng = random.Random(f"{seed}:{k}")
        # drawn from the whole vocabulary (a sorted prefix of it would favour capitals and early letters)
        distractors = [w for w in rng.sample(pool, num_choices) if w != word][: num_choices - 1]
        choices = [f" {w}" for w in distractors]
        answer = rng.randrange(num_choices)
        choices.insert(answer, f" {word}")
        examples.append(Example(context, choices, answer))
    return Task(BUILTIN, examples, cloze=True)


def _encode_pair(tokenizer, context: str, choice: str) -> tuple[list[int], list[int]]:
    """Context and continuation tokens as the harness splits them: the whole text encoded once, the
    continuation being what follows the context's own tokens."""
    whole = tokenizer(context + choice, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    if whole[: len(ctx)] != ctx:  # a merge across the boundary: encode the two apart
        return ctx, tokenizer(choice, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx) :]


def choice_rows(example: Example, tokenizer, kind: str, max_len: int) -> list[list[dict[str, torch.Tensor]]]:
    """For each choice, its scoring rows (``input_ids``/``labels`` of shape (1, T)); see the module docstring.
    The context is cut from the left so ``context + choice`` fits ``max_len``."""
    out = []
    for choice in example.choices:
        ctx, cont = _encode_pair(tokenizer, example.context, choice)
        if kind == "decoder" and not ctx:  # a decoder scores a token from the one before: the document separator
            ctx = [separator_id(tokenizer)]  # before an empty context, as lm-evaluation-harness puts its EOT there
        cont = cont[-(max_len - 1) :]
        ids = (ctx + cont)[-max_len:]
        first = len(ids) - len(cont)
        rows = []
        positions = range(first, len(ids))
        if kind == "decoder":
            labels = [IGNORE_INDEX] * first + ids[first:]
            rows.append({"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels])})
        else:
            for p in positions:
                masked, labels = list(ids), [IGNORE_INDEX] * len(ids)
                masked[p], labels[p] = mask_id(tokenizer), ids[p]
                rows.append({"input_ids": torch.tensor([masked]), "labels": torch.tensor([labels])})
        out.append(rows)
    return out


def heldout_documents(cfg: DataConfig, seed: int):
    """The held-out documents validation packs, as texts, once each: ``data.val_sources``, else the ``val_holdout``
    share. A document of token shards is decoded with the shards' tokenizer (:func:`_as_texts`)."""
    from pretrain.data.bad_records import BadRecords
    from pretrain.data.sources import training_sources, validation_sources
    from pretrain.data.stream import DocumentStream, unique_documents

    if cfg.val_sources:
        sources = validation_sources(cfg)
        docs = DocumentStream(sources, seed, role="all", val_holdout=0.0, bad=BadRecords(cfg.bad_records))
    else:
        sources = training_sources(cfg)
        docs = DocumentStream(sources, seed, role="val", val_holdout=cfg.val_holdout, bad=BadRecords(cfg.bad_records))
    return _as_texts(unique_documents(docs), sources)


def _as_texts(documents, sources):
    """``documents`` with each one of token shards (a NumPy array of token ids) decoded to its text by the tokenizer
    kept in the shard directory (every shard directory of a run has the same: :mod:`pretrain.data.shards.compat`)."""
    shards = [s for s in sources if s.format == "shards"]
    if not shards:
        return documents
    from tokenizers import Tokenizer

    from pretrain.data.shards.format import TOKENIZER_DIR

    tokenizer = Tokenizer.from_file(str(Path(shards[0].files[0]) / TOKENIZER_DIR / "tokenizer.json"))
    return (d if isinstance(d, str) else tokenizer.decode(d.tolist()) for d in documents)


def load_tasks(specs: list[str], data: DataConfig, *, max_examples: int, num_choices: int, seed: int) -> list[Task]:
    """``eval.tasks`` loaded: task files and the built-in held-out task."""
    return [
        heldout_lastword(heldout_documents(data, seed), max_examples, num_choices, seed)
        if spec == BUILTIN
        else load_jsonl_task(spec, max_examples)
        for spec in specs
    ]
