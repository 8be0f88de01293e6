"""``./launch.sh bench --vs-hf`` end to end: both commands on a tiny model in a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.train.callbacks.speed import LOOP_WARMUP_STEPS
from tests.harness import cli


def test_bench_vs_hf_runs_both_commands(tmp_path):
    """A tiny decoder, 8 steps: both commands run, the JSON has both sides and the ratios."""
    proc = cli(
        tmp_path,
        "bench",
        "--vs-hf",
        "--json",
        "--loop-steps",
        "8",
        "--corpus",
        "demo",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.max_seq_len=32",
        "train.warmup_steps=2",
        "data.tokenizer_vocab_size=512",
        "data.tokenizer_train_docs=2000",
        "train.log_every=2",
        "stability.health_every=2",
        "train.val_sequences=8",
        expect=0,
        timeout=900,
    )
    r = json.loads(proc.stdout)
    assert r["hf_class"] == "LlamaForCausalLM" and r["steps"] == 8 and r["corpus"] == "demo"
    for side in ("hf", "ours"):
        s = r[side]
        assert s["steps"] == 8 and s["threads"] == 2 and s["steps_timed"] == 8 - LOOP_WARMUP_STEPS - 1, (side, s)
        assert s["tokens_per_s"] > 0 and s["wall_s"] > 0 and s["final_loss"] < 7.0, (side, s)
    assert r["tokens_per_s_ratio"] == pytest.approx(r["ours"]["tokens_per_s"] / r["hf"]["tokens_per_s"])
    assert r["wall_ratio"] == pytest.approx(r["ours"]["wall_s"] / r["hf"]["wall_s"])
    runs = r["hf"]["runs"]  # Trainer before and after ours; its side is their mean
    assert len(runs) == 2 and r["hf"]["wall_s"] == pytest.approx((runs[0]["wall_s"] + runs[1]["wall_s"]) / 2)
    assert r["hf"]["tokens_per_s"] == pytest.approx((runs[0]["tokens_per_s"] + runs[1]["tokens_per_s"]) / 2)
    assert r["repeats"] == 1 and r["paired_tokens_per_s_ratios"] == [pytest.approx(r["tokens_per_s_ratio"])]
    assert not list(Path(tmp_path).glob("checkpoints"))  # the runs went to temporary directories
