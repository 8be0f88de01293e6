"""Which earlier runs a study may reuse (``benchmarks/reuse.py``): the config match and the stores a path names."""

from __future__ import annotations

import pytest

from benchmarks.reuse import PARAM_CHARS, same_config, stores
from pretrain.config import ConfigError

WANT = {"model.num_layers": 4, "train.lr": 0.002, "train.seed": 0, "data.sources": "[1, 2]", "data.tokenizer": ""}


def _logged(want: dict) -> dict[str, str]:
    return {k: str(v)[:PARAM_CHARS] for k, v in want.items()}


def test_the_same_config_matches_whatever_its_locations():
    assert same_config(WANT, _logged(WANT))
    moved = {**WANT, "checkpoint.dir": "/a", "tracking.run_name": "x", "data.cache_dir": "/c"}
    assert same_config(moved, {**_logged(WANT), "checkpoint.dir": "/b", "data.cache_dir": "/d"}), "where, not what"
    assert not same_config({**WANT, "train.seed": 1}, _logged(WANT)), "another seed"
    assert not same_config({**WANT, "train.lr": 0.001}, _logged(WANT))
    assert not same_config({**WANT, "model.z_loss": 0.0}, _logged(WANT)), "a key the run never logged"
    long = {**WANT, "data.sources": "x" * (PARAM_CHARS + 10)}
    assert same_config(long, _logged(long)), "MLflow keeps the first 6000 characters"


def test_the_tokenizer_matches_by_content(tmp_path):
    for name, text in (("a", '{"v": 1}'), ("b", '{"v": 1}'), ("c", '{"v": 2}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(text)
    want = {**WANT, "data.tokenizer": str(tmp_path / "a")}
    assert same_config(want, {**_logged(WANT), "data.tokenizer": str(tmp_path / "b")}), "a copy of it"
    assert same_config(want, {**_logged(WANT), "data.tokenizer": str(tmp_path / "b" / "tokenizer.json")})
    assert not same_config(want, {**_logged(WANT), "data.tokenizer": str(tmp_path / "c")}), "another tokenizer"
    assert not same_config(want, {**_logged(WANT), "data.tokenizer": str(tmp_path / "gone")})
    assert not same_config(want, _logged(WANT)), "one run trained its tokenizer, the other was given one"


def test_stores_under_a_path(tmp_path):
    for d in ("s0/bench-growth/1", "s0/bench-growth/2"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "mlflow.db").write_bytes(b"")
    found = stores([tmp_path / "s0", tmp_path / "s0/bench-growth/1/mlflow.db"])
    assert [p.parent.name for p in found] == ["1", "2"], "each store once"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--reuse .*empty: no MLflow store"):
        stores([tmp_path / "empty"])
