"""The config tree: strict loading, full key paths in errors, round-trip, every preset validates."""

from __future__ import annotations

import subprocess

import pytest

from pretrain.config import (ConfigError, RunConfig, config_hash, dump_yaml, from_dict, load_config, to_dict)
from tests.conftest import PYTHON, ROOT, cli_env

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


@pytest.mark.parametrize("override, message", [
    ("model.num_layerz=3", "model.num_layerz: unknown key"),
    ("model.num_layers=abc", "model.num_layers: expected int, got str 'abc'"),
    ("model.num_layers=2.5", "model.num_layers: expected int"),
    ("train.lr=fast", "train.lr: expected float"),
    ("train.lr=1e-3e", "train.lr: expected float"),
    ("model.kind=rnn", "model.kind: expected one of decoder, encoder"),
    ("tracking.enabled=3", "tracking.enabled: expected bool"),
    ("data.sources=[{pth: x}]", "data.sources[0].pth: unknown key"),
    ("data.sources=[{path: x, weight: heavy}]", "data.sources[0].weight: expected float"),
    ("nosuch.key=1", "nosuch: unknown key"),
    ("model.num_heads=3", "model.num_heads: 3 does not divide model.hidden_size"),
    ("zero.stage=4", "zero.stage: must be 0, 1, 2 or 3"),
    ("cluster.num_workers=16", "cluster.num_workers: 16 workers but only data.num_streams=8"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "demo-decoder.yaml", [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


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


@pytest.mark.parametrize("args", [["model.num_layerz=3"], ["configs/nope.yaml"], ["train.max_steps=ten"]])
def test_cli_config_errors_exit_2_with_one_line(tmp_path, args):
    proc = subprocess.run([PYTHON, "-m", "pretrain", "train", *args], cwd=ROOT, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr


def test_exponent_floats_without_dot_are_floats():
    assert load_config(None, ["train.lr=3e-4"]).train.lr == 3e-4
