"""Overrides of one item of a list of sections (``data.sources[0].text_field=content``), and the one-line refusals
that say which keys and indexes exist: in config loading (``pretrain/config/loading.py``) and through ``train``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pretrain.cli import main
from pretrain.config import ConfigError, DataConfig, SourceConfig, load_config
from tests.conftest import ROOT

DECODER = ROOT / "configs" / "demo-decoder.yaml"


def _valid(cls: type) -> str:
    """The list of keys a refusal of an unknown key in section ``cls`` names."""
    return f"(valid: {', '.join(sorted(f.name for f in dataclasses.fields(cls)))})"


def test_an_index_sets_one_key_of_one_item():
    cfg = load_config(DECODER, ["data.sources[0].text_field=content"])
    assert [(s.path, s.text_field) for s in cfg.data.sources] == [("demo", "content")]  # the default list's item
    cfg = load_config(
        None,
        [
            "data.sources=[{path: a.jsonl}, {path: b.jsonl, weight: 2}]",
            "data.sources[1].text_field=body",
            "data.sources[1].weight=3",
            "data.val_sources=[{path: v.jsonl}]",
            "data.val_sources[0].name=held",
        ],
    )
    assert [(s.path, s.text_field, s.weight) for s in cfg.data.sources] == [
        ("a.jsonl", "text", 1.0),
        ("b.jsonl", "body", 3.0),
    ]
    assert cfg.data.val_sources[0].name == "held"
    cfg = load_config(None, ["data.sources[0]={path: x.txt, name: x}"])  # a whole item
    assert (cfg.data.sources[0].path, cfg.data.sources[0].name) == ("x.txt", "x")


def test_a_section_given_whole_merges_into_the_presets():
    """``data={num_streams: 64}`` changes that key and keeps the preset's others (sources, tokenizer size), as a config
    file's section is merged; a list inside it still replaces the list whole."""
    llama = load_config(ROOT / "configs" / "llama-1b.yaml")
    cfg = load_config(ROOT / "configs" / "llama-1b.yaml", ["data={num_streams: 64}"])
    assert cfg.data.num_streams == 64
    assert dataclasses.replace(cfg.data, num_streams=llama.data.num_streams) == llama.data
    gpt = load_config(ROOT / "configs" / "gpt-125m.yaml")
    cfg = load_config(ROOT / "configs" / "gpt-125m.yaml", ["model={num_layers: 6}"])
    assert cfg.model == dataclasses.replace(gpt.model, num_layers=6)
    cfg = load_config(None, ["data.sources=[{path: a.txt}, {path: b.txt}]", "data={sources: [{path: c.txt}]}"])
    assert [s.path for s in cfg.data.sources] == ["c.txt"]
    cfg = load_config(None, ["layer_drop={early_exit: {layers: all}}", "layer_drop={rate: 0.1}"])
    assert (cfg.layer_drop.early_exit.layers, cfg.layer_drop.rate) == ("all", 0.1)


def test_an_index_into_the_config_files_list(tmp_path):
    """The file's list is changed, not the default; an item that a YAML alias shares with another list stays as it
    is there."""
    p = tmp_path / "c.yaml"
    p.write_text("data:\n  sources: &s\n  - {path: a.jsonl}\n  val_sources: *s\n")
    cfg = load_config(p, ["data.sources[0].text_field=content"])
    assert (cfg.data.sources[0].path, cfg.data.sources[0].text_field) == ("a.jsonl", "content")
    assert cfg.data.val_sources[0].text_field == "text"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "data.sources[1].text_field=x",
            "data.sources[1]: index 1 is out of range: data.sources has 1 item(s) (indexes 0 to 0); to add one, "
            "give the whole list: data.sources=[...]",
        ),
        ("data.val_sources[0].path=x", "data.val_sources[0]: index 0 is out of range: data.val_sources has 0 item(s)"),
        ("data.sources[x].path=x", "data.sources[x]: index x is out of range"),
        ("data.text_field=content", f"data.text_field: unknown key {_valid(DataConfig)}"),
        ("data.sources[0].text=content", f"data.sources[0].text: unknown key {_valid(SourceConfig)}"),
        (
            "data.sources.text_field=content",
            "data.sources: a list; name an item by its index, e.g. data.sources[0].text_field=...",
        ),
        (
            "data.sources.0.path=x",
            "data.sources: a list; name an item by its index, e.g. data.sources[0].path=...",
        ),
        ("data.sources[0].path=", "data.sources[0].path: empty (a file, directory, glob or hub dataset name)"),
        ("model[0].num_layers=2", "model[0]: model is not a list"),
        ("train.lr.peak=1", "train.lr.peak: train.lr is a value, not a section"),
        ("data.sources[0].weight=heavy", "data.sources[0].weight: expected float"),
    ],
)
def test_refusals_say_what_exists_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(DECODER, [override])
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_train_takes_a_source_key_by_index(workdir, capsys):
    """Through the command: records whose text is under ``content`` are refused with the default text field and
    accepted with ``data.sources[0].text_field=content`` (``--dry-run``: the checks a run makes first)."""
    corpus = workdir / "c.jsonl"
    corpus.write_text("".join(json.dumps({"content": f"document {i} " * 20, "id": i}) + "\n" for i in range(200)))
    small = ["data.tokenizer_train_docs=100", "data.num_streams=2", "train.global_batch_size=8"]
    assert main(["train", "--dry-run", f"data.sources[0].path={corpus}", *small]) == 2
    err = capsys.readouterr().err
    assert "the records have the fields content, id: set text_field" in err
    args = ["train", "--dry-run", f"data.sources[0].path={corpus}", "data.sources[0].text_field=content", *small]
    assert main(args) == 0
    assert f"data         {corpus}" in capsys.readouterr().out
    assert main(["train", "data.text_field=content"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.text_field: unknown key (valid: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps=0144", "train.max_steps: expected int, got str '0144'"),  # YAML 1.1: octal 100
        ("train.seed=010", "train.seed: expected int, got str '010'"),  # octal 8 (and 08 is text)
        ("checkpoint.dir=runs #1", "checkpoint.dir: 'runs #1' holds ' #', which YAML reads as the start of a comment"),
        ('name="\\ud800"', "name: '\\ud800' is not valid Unicode text (a lone surrogate)"),
        ("name=no", "name: expected str, got bool False, quote it (YAML reads yes/no, on/off, true/false as a"),
    ],
    ids=["octal", "octal-seed", "comment", "surrogate", "yes-no"],
)
def test_a_value_yaml_would_silently_change_is_refused(override, message):
    """A leading zero (YAML 1.1 reads an octal number), a `` #`` (the rest is a comment: the value was cut short),
    a lone surrogate (a traceback when it was written out): one line each, not another value."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message)
    assert main(["train", "--dry-run", override]) == 2
    quoted = load_config(None, ["checkpoint.dir='runs #1'", "train.seed=0", "train.max_steps=9 # a comment"])
    assert (quoted.checkpoint.dir, quoted.train.seed, quoted.train.max_steps) == ("runs #1", 0, 9)


def test_a_key_is_found_in_either_form_and_an_indexed_override_is_left_alone():
    """``overridden`` (the resume's guards): ``section.key=v`` and ``section={key: v}`` are the key; an override of
    an item of a list (``data.sources[1].path=...``) is not, and is not applied to an empty tree (its index would
    be out of range there)."""
    from pretrain.config.loading import overridden

    given = ["data.tokenizer=/a", "data={tokenizer: /b, repeat: true}", "data.sources[1].path=/moved.txt", "x.y=1"]
    assert overridden(given, "data", "tokenizer") == ["/a", "/b"]
    assert overridden(["data.val_sources[0].path=/v.jsonl", "growth.schedule[0].depth=2x"], "data", "tokenizer") == []
