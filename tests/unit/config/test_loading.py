"""The config tree: strict loading, full key paths in errors, round-trip, every preset validates (the command's
one-line errors: ``tests/integration/cli/test_config.py``)."""

from __future__ import annotations

import re

import pytest

from pretrain.config import ConfigError, RunConfig, config_hash, dump_yaml, from_dict, load_config, to_dict
from tests.conftest import ROOT

PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


def test_presets_exist():
    names = {p.stem for p in PRESETS}
    assert {"demo-decoder", "demo-encoder", "gpt-125m", "bert-base", "llama-1b"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads_validates_and_round_trips(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    again = from_dict(to_dict(cfg))
    assert again == cfg
    assert load_config(None, base=__import__("yaml").safe_load(dump_yaml(cfg))) == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.num_layerz=3", "model.num_layerz: unknown key"),
        ("model.num_layers=abc", "model.num_layers: expected int, got str 'abc'"),
        ("model.num_layers=2.5", "model.num_layers: expected int"),
        ("train.lr=fast", "train.lr: expected float"),
        ("train.lr=1e-3e", "train.lr: expected float"),
        ("model.kind=rnn", "model.kind: expected one of decoder, encoder"),
        ("tracking.enabled=3", "tracking.enabled: expected bool"),
        ("data.sources=[{pth: x}]", "data.sources[0].pth: unknown key"),
        ('data.cache_dir="/tmp/a\\0b"', "data.cache_dir: '/tmp/a\\x00b' holds a NUL character"),
        ("data.sources=[{path: x, weight: heavy}]", "data.sources[0].weight: expected float"),
        ("nosuch.key=1", "nosuch: unknown key"),
        ("model.num_heads=3", "model.num_heads: 3 does not divide model.hidden_size"),
        ("zero.stage=4", "zero.stage: must be 0, 1, 2 or 3"),
        ("cluster.num_workers=16", "cluster.num_workers: 16 workers but only data.num_streams=8"),
        # values the training would reject later are refused here, naming the key
        ("model.max_seq_len=1", "model.max_seq_len: a decoder predicts the next token"),
        ("data.tokenizer_vocab_size=3", "data.tokenizer_vocab_size: 3 is below the 260 tokens"),
        ("model.vocab_size=100", None),  # models are built alone too; against the tokenizer: the driver's check
        ("data.tokenizer_train_docs=-1", "data.tokenizer_train_docs: must be > 0"),
        ("train.beta2=1.0", "train.beta2: must be in [0, 1)"),
        ("train.eps=-1e-8", "train.eps: must be > 0"),
        ("train.eps=0", "train.eps: must be > 0, got 0"),
        ("train.weight_decay=-0.1", "train.weight_decay: must be >= 0"),
        ("model.init_std=-0.02", "model.init_std: must be > 0"),
        ("model.init_std=0", "model.init_std: must be > 0, got 0"),
        ("model.norm_eps=0", "model.norm_eps: must be > 0, got 0"),
        ("model.norm_eps=-1", "model.norm_eps: must be > 0, got -1"),
        ("zero.reduce_bucket_size=0", "zero.reduce_bucket_size: must be > 0, got 0"),
        ("zero.reduce_bucket_size=-5", "zero.reduce_bucket_size: must be > 0, got -5"),
        ("model.rope_theta=0", "model.rope_theta: must be > 0"),
        ("data.piece_chars=-1", "data.piece_chars: must be >= 0"),
        ("train.lr=.nan", "train.lr: expected a finite float"),
        ("train.lr=1e999", "train.lr: expected a finite float"),
        ("model.dropout=.inf", "model.dropout: expected a finite float"),
        ("train.seed=99999999999999999999999", "train.seed: 99999999999999999999999 is out of range"),
        ("train.global_batch_size=8000000000", "train.global_batch_size: 8000000000 is more than 1,048,576"),
        ("moe.num_experts=2", None),
        ("=5", "=5: no key before '='; overrides look like key.sub=value"),
        (".model=5", ".model: an empty key (or part of one, between dots or at either end)"),
        ("model..num_layers=5", "model..num_layers: an empty key"),
        ("model.vocab_multiple=-64", "model.vocab_multiple: must be > 0, got -64"),
        ("model.kind=yes", "model.kind: expected one of decoder, encoder; got True (YAML reads yes/no, on/off"),
        ("model.hidden_size=4000000000", "model.hidden_size: 4,000,000,000 is more than 1,048,576"),
        ("model.num_layers=1000000000", "model.num_layers: 1,000,000,000 is more than 10,000"),
        ("model.num_layers=10000", None),
        ("model.norm_eps=1:00", "model.norm_eps: expected float, got str '1:00'"),  # YAML 1.1 would read 60
        ("train.max_steps=1:00", "train.max_steps: expected int, got str '1:00'"),
        ("growth.schedule=[{at_step: 9, experts: 5000, top_k: 1}]", "growth.schedule[0].experts: 5,000 is more than"),
        ("growth.schedule=[{at_step: 1, depth: 2y}]", "growth.schedule[0].depth: '2y': expected a factor like 2x"),
        ("growth.schedule=[{at_step: 1, experts: 4, top_k: 9}]", "growth.schedule[0].top_k: must be in [1, experts=4]"),
        ("growth.schedule=[{at_step: 1, experts: 4, top_k: 0}]", "growth.schedule[0].top_k: must be in [1, experts=4]"),
        ("growth.schedule=[{at_step: 1, experts: 1}]", "growth.schedule[0].top_k: must be in [1, experts=1], got 2"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    if message is None:  # a control: valid as it is
        load_config(ROOT / "configs" / "demo-decoder.yaml", [override])
        return
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "demo-decoder.yaml", [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["zero.stage=0", "zero.offload_optimizer=true"], "zero.offload_optimizer: ZeRO offloads the optimizer state"),
        (["stability.policy=rollback", "checkpoint.every_steps=0"], "stability.policy: rollback returns to a good"),
        (["data.val_holdout=0", "train.stop_at_val_loss=2"], "train.stop_at_val_loss: 2 needs validation, but data."),
        (["data.val_holdout=0", "train.val_every_flops=1e9"], "train.val_every_flops: 1e+09 needs validation, but"),
        (["train.val_sequences=0", "train.stop_at_val_loss=2"], "train.stop_at_val_loss: 2 needs validation, but tr"),
        # controls: the same settings where they do something
        (["zero.offload_optimizer=true"], None),  # at ZeRO-1, the preset's stage
        (["stability.policy=rollback"], None),
        (["data.val_holdout=0", "data.val_sources=[{path: v.txt}]", "train.stop_at_val_loss=2"], None),
    ],
)
def test_settings_that_would_do_nothing_are_refused_naming_both(overrides, message):
    if message is None:
        load_config(ROOT / "configs" / "demo-decoder.yaml", overrides)
        return
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(ROOT / "configs" / "demo-decoder.yaml", overrides)


@pytest.mark.parametrize(
    "override, message",
    [
        ("layer_drop.early_exit.layers=[1.5]", "layer_drop.early_exit.layers[0]: expected int, got float 1.5"),
        ("layer_drop.early_exit.layers=[1, x]", "layer_drop.early_exit.layers[1]: expected int, got str 'x'"),
        ("layer_drop.early_exit.layers=3", "layer_drop.early_exit.layers: expected str or a list of int, got int 3"),
        ("growth.schedule=[{at_step: 10, depth: 2.5}]", "growth.schedule[0].depth: expected int, got float 2.5"),
        ("growth.schedule=[{at_step: 10, depth: [2]}]", "growth.schedule[0].depth: expected str or int, got list [2]"),
        (
            "train.activation_checkpointing=3",
            "train.activation_checkpointing: expected one of none, full, selective or bool, got int 3",
        ),
        ("train.activation_checkpointing=most", "train.activation_checkpointing: expected one of none, full, selecti"),
    ],
)
def test_a_union_field_reports_the_branch_of_the_values_kind(override, message):
    """A field of several types (``str | list[int]``, ``str | int``, ``Literal | bool``) reports the error of the type
    the value has the kind of (a list's bad item by its index), or every type when it has none of their kinds."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "demo-decoder.yaml", [override])
    assert str(e.value).startswith(message), str(e.value)


def test_yaml_unknown_nested_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  hidden: 3\n")
    with pytest.raises(ConfigError, match=r"^model\.hidden: unknown key"):
        load_config(p)


def test_int_accepted_for_float_and_hash_ignores_storage():
    a = load_config(None, ["train.lr=1", "checkpoint.dir=/x"])
    b = load_config(None, ["train.lr=1.0", "checkpoint.dir=/y"])
    assert a.train.lr == 1.0 and config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(load_config(None, ["train.lr=2"]))


def test_exponent_floats_without_dot_are_floats():
    assert load_config(None, ["train.lr=3e-4"]).train.lr == 3e-4


def test_checks_that_depend_on_the_model_kind_and_tokenizer():
    assert load_config(ROOT / "configs" / "demo-encoder.yaml", ["model.max_seq_len=1"]).model.max_seq_len == 1
    # with a given tokenizer the trained tokenizer's size is not used
    cfg = load_config(None, ["data.tokenizer=/some/dir", "data.tokenizer_vocab_size=3", "model.vocab_size=100"])
    assert cfg.data.tokenizer_vocab_size == 3
    with pytest.raises(ConfigError, match=r"^moe\.every: 9 selects no block of model\.num_layers=4"):
        load_config(None, ["moe.num_experts=2", "moe.every=9"])
    deep = load_config(None, ["model.num_layers=10000", "moe.num_experts=2", "moe.every=9999"])
    assert deep.model.num_layers == 10_000  # the most accepted (model.num_layers beyond: refused, by its size)


def test_yaml_duplicate_keys_name_the_key_and_both_lines(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("name: x\nmodel:\n  num_layers: 2\n  hidden_size: 64\n  num_layers: 3\n")
    with pytest.raises(ConfigError, match=rf"^{p}: model\.num_layers: duplicate key \(lines 3 and 5\)$"):
        load_config(p)
    p.write_text("model: {num_layers: 2}\ntrain: {lr: 1}\nmodel: {num_layers: 3}\n")
    with pytest.raises(ConfigError, match=r"model: duplicate key \(lines 1 and 3\)"):
        load_config(p)
    p.write_text("data:\n  sources:\n  - {path: a.txt, weight: 1, weight: 2}\n")
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.weight: duplicate key \(lines 3 and 3\)"):
        load_config(p)
    p.write_text("base: &b {num_layers: 2}\nmodel:\n  <<: *b\n  hidden_size: 64\n")  # a merge key is no duplicate
    with pytest.raises(ConfigError, match=r"^base: unknown key"):
        load_config(p)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "the config file is empty"),
        (b"# only a comment\n", "the config file is empty"),
        (b"false\n", "expected a mapping at the top level, got a bool"),
        (b"- 1\n- 2\n", "expected a mapping at the top level, got a list"),
        (b"model: {\n", "invalid YAML: "),
        (b"a: 1\n---\nb: 2\n", "invalid YAML: "),
        (b"name: \x1f\n", "invalid YAML: "),
        (b"\xff\xfe\x00m", "not UTF-8 text"),
        (b"name: 2001-13-45\n", "invalid YAML value"),
        (b"[" * 3000, "invalid YAML"),
    ],
)
def test_bad_yaml_files_are_one_line(tmp_path, content, message):
    p = tmp_path / "c.yaml"
    p.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value) and "\n" not in str(e.value)


def test_an_explicit_empty_mapping_is_the_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("{}\n")
    assert load_config(p) == load_config(None)


def test_config_errors_are_one_line_even_for_multiline_input():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["name\nx"])
    assert "\n" not in str(e.value)
    assert str(ConfigError("a\nb")) == "a b"


def test_a_derived_growth_point_does_not_skip_the_entry_checks():
    """An entry whose ``at_step`` is derived (``at_fraction``, ``at_tokens``) has its targets and ``top_k`` checked
    when the config is loaded, not only once the step is derived."""
    base = [ROOT / "configs" / "demo-decoder.yaml", "train.max_flops=1e12"]
    for schedule, message in (
        ("[{at_fraction: 0.5, depth: 2y}]", "growth.schedule[0].depth: '2y'"),
        ("[{at_tokens: 5000, experts: 2, top_k: 3}]", "growth.schedule[0].top_k: must be in [1, experts=2]"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(base[0], [base[1], f"growth.schedule={schedule}"])


def test_a_stored_config_an_older_version_accepted_still_loads(tmp_path):
    """The checks of a config as written (settings that would do nothing, growth points out of order) are not made
    on a run's stored config: a checkpoint written before them is still exported, evaluated and resumed."""
    from pretrain.config import dump_yaml, from_dict, to_dict

    cfg = load_config(ROOT / "configs" / "demo-decoder.yaml", ["stability.policy=rollback", "train.max_flops=1e12"])
    stored = to_dict(cfg)
    stored["checkpoint"]["every_steps"] = 0  # what an older version wrote: rollback with one checkpoint at the end
    stored["zero"].update(stage=0, offload_optimizer=True)
    stored["growth"]["schedule"] = [{"at_fraction": 0.5, "at_step": 50}, {"at_fraction": 0.2, "at_step": 51}]
    assert from_dict(stored).checkpoint.every_steps == 0
    (tmp_path / "config.yaml").write_text(dump_yaml(from_dict(stored)))
    assert load_config(None, ["train.max_steps=200"], base=stored).zero.offload_optimizer  # resume RUN k=v
    with pytest.raises(ConfigError, match=re.escape("growth.schedule[0]: at_step 50 and at_fraction 0.5 both")):
        load_config(tmp_path / "config.yaml", [])  # the same file given as a config to train: as written
