"""The decoding half of ``bench --early-exit`` in-process on an in-memory model: held-out prompts from a file, every
exit decodes every prompt identically to plain greedy, the pooled acceptance, the best exit. The command itself
(through ``./launch.sh generate`` too) is in ``tests/integration/bench/test_early_exit_decoding.py``."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.early_exit_decoding import decoding_benchmark, heldout_prompts
from pretrain.config import ConfigError
from tests.conftest import corpus_lines
from tests.unit.eval.test_generate import LAYERS, llama  # noqa: F401 - the fixture is used by name
from tests.unit.export.test_hf import one_thread  # noqa: F401


def test_decoding_benchmark_on_heldout_prompts(llama, tmp_path):  # noqa: F811
    val = tmp_path / "val.txt"
    val.write_text("\n".join(corpus_lines(400)[-200:]) + "\n", encoding="utf-8")
    prompts = heldout_prompts(llama, 5, 8, [str(val)])
    assert len(prompts) == 5 and len(set(prompts)) == 5
    assert all(len(llama.tokenizer(p, add_special_tokens=False)["input_ids"]) <= 8 for p in prompts)
    r = decoding_benchmark(llama, prompts, [1, LAYERS - 1], max_new_tokens=10, draft_tokens=3)
    assert r["prompts"] == 5 and r["greedy"]["tokens"] > 0 and r["greedy"]["tokens_per_s"] > 0
    for e in ("1", str(LAYERS - 1)):
        t = r["exits"][e]
        assert t["identical"] and t["identical_prompts"] == 5 and t["tokens"] == r["greedy"]["tokens"]
        assert 0 <= t["accepted"] <= t["drafted"] and t["acceptance"] == t["accepted"] / t["drafted"]
        assert t["speedup"] == pytest.approx(t["tokens_per_s"] / r["greedy"]["tokens_per_s"])
    assert r["best_exit"] in (1, LAYERS - 1)
    assert r["best_speedup"] == max(t["speedup"] for t in r["exits"].values())
    assert len(r["_plain_texts"]) == 5


def test_prompts_need_heldout_data(llama):  # noqa: F811
    with pytest.raises(ConfigError, match="pass --data"):
        heldout_prompts(dataclasses.replace(llama, data=None), 5, 8, [])


def test_study_options_are_refused_with_a_model():
    """``--model`` benchmarks one model: the study's overrides, ``--reuse`` and ``--jobs`` are refused in one
    line."""
    from benchmarks.early_exit_decoding import parse_args, run

    with pytest.raises(ConfigError, match="key=value overrides are for the study only"):
        run(parse_args(["--model", "x", "train.seed=1"]))
    with pytest.raises(ConfigError, match="--reuse is for the study only"):
        run(parse_args(["--model", "x", "--reuse", "/tmp/s"]))
    with pytest.raises(ConfigError, match="--jobs is for the study only"):
        run(parse_args(["--model", "x", "--jobs", "2"]))
