"""The user's cache of small values (``pretrain/user_cache.py``): exact specs only, atomic writes, misses never
errors."""

from __future__ import annotations

import json

from pretrain.user_cache import read_value, value_path, write_value


def test_a_value_is_read_back_only_for_exactly_its_spec(cache):
    spec = {"a": 1, "b": [1, 2], "c": {"d": "x"}}
    assert read_value("kind", spec) is None
    assert write_value("kind", spec, 2.5)
    assert read_value("kind", {"c": {"d": "x"}, "b": [1, 2], "a": 1}) == 2.5  # key order does not matter
    assert read_value("kind", {**spec, "a": 2}) is None
    assert read_value("other", spec) is None
    # a file under the spec's key that holds another spec (a truncated-hash collision) is a miss
    path = value_path("kind", spec)
    path.write_text(json.dumps({"spec": {"a": 3}, "value": 9.0}))
    assert read_value("kind", spec) is None
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_a_damaged_or_unwritable_cache_is_a_miss_and_can_be_turned_off(cache, monkeypatch):
    spec = {"x": 1}
    assert write_value("kind", spec, 1.0)
    value_path("kind", spec).write_text('{"spec": {"x": 1}, "val')  # cut short
    assert read_value("kind", spec) is None
    assert write_value("kind", spec, 1.0) and read_value("kind", spec) == 1.0  # replaced by the next write
    monkeypatch.setenv("PRETRAIN_VALUE_CACHE", "0")
    assert read_value("kind", spec) is None
    monkeypatch.delenv("PRETRAIN_VALUE_CACHE")
    cache.joinpath("blocked").write_text("a file where the cache wants a folder")
    assert not write_value("blocked", spec, 1.0)
    assert not write_value("kind", spec, object())  # not JSON: refused, nothing written
    assert read_value("kind", spec) == 1.0
