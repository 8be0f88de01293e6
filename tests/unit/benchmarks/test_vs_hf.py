"""``./launch.sh bench --vs-hf``: both sides train the same architecture from the same weights on the same token
stream. The bench mode end to end is in ``tests/integration/bench/test_vs_hf.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import vs_hf as bench_vs_hf
from tests.conftest import ROOT

SPECIAL = SimpleNamespace(bos_token_id=0, eos_token_id=0, pad_token_id=1)


def _demo_cfg(*extra: str):
    overrides = bench_vs_hf.comparison_overrides("demo", steps=60, batch=16, threads=2)
    return bench_vs_hf.comparison_config(
        ROOT / "configs" / "demo-decoder.yaml", [*overrides, "model.vocab_size=4096", *extra]
    )


def test_hf_side_is_the_demo_architecture_with_the_same_weights():
    from pretrain.model import num_parameters

    cfg = _demo_cfg()
    ours, hf = bench_vs_hf.build_pair(cfg, SPECIAL)
    assert type(hf).__name__ == "LlamaForCausalLM"
    c = hf.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        4,
        256,
        4,
        2,
        4096,
    )
    assert c.tie_word_embeddings and num_parameters(ours) == hf.num_parameters() > 3_000_000
    ids = torch.randint(0, 4096, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same function: our init carried over exactly (fp32 rounding only)
        diff = (ours.eval()(ids).logits - hf(input_ids=ids).logits).abs().max().item()
    assert diff < 1e-4
    with torch.no_grad():  # and a loss on the same labels (both shift them inside)
        a = ours(ids, labels=ids).loss.item()
        b = hf(input_ids=ids, labels=ids).loss.item()
    assert a == pytest.approx(b, abs=1e-4)


def test_comparison_fixes_batch_steps_precision_threads_and_one_worker():
    cfg = _demo_cfg()
    t = cfg.train
    assert (t.max_steps, t.global_batch_size, t.micro_batch_size, t.precision, t.num_threads) == (60, 16, 16, "fp32", 2)
    assert cfg.cluster.num_workers == 1 and cfg.data.sources[0].path == "demo"
    with pytest.raises(Exception, match="num_workers=1"):
        _demo_cfg("cluster.num_workers=2")


def test_corpus_defaults_to_the_shared_wikitext_else_the_demo(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_vs_hf, "SHARED_CORPUS", tmp_path / "absent.txt")
    assert bench_vs_hf.default_corpus() == "demo"
    text = tmp_path / "wiki.txt"
    text.write_text("a line\n")
    monkeypatch.setattr(bench_vs_hf, "SHARED_CORPUS", text)
    assert bench_vs_hf.default_corpus() == str(text)
    src = bench_vs_hf.comparison_overrides(str(text), 60, 16, 2)[0]
    assert src == f"data.sources=[{{path: '{text.resolve()}'}}]"


def test_token_stream_is_our_first_steps_in_order():
    from pretrain.config import make_plan
    from pretrain.data import TrainBatches, load_or_train_tokenizer

    cfg = _demo_cfg("data.tokenizer_vocab_size=512", "model.vocab_size=512", "data.tokenizer_train_docs=300")
    tok = load_or_train_tokenizer(cfg.data)
    ids = bench_vs_hf.token_stream(cfg, tok, steps=3)
    assert ids.shape == (48, 128) and ids.dtype == torch.int64
    batches = TrainBatches(cfg.data, kind="decoder", tokenizer=tok, plan=make_plan(cfg, 1), rank=0, seed=cfg.train.seed)
    assert torch.equal(ids[32:], [batches.next_step() for _ in range(3)][2]["input_ids"])


def test_table_shows_both_sides_and_the_targets():
    side = {
        "tokens_per_s": 1000.0,
        "best_window_tokens_per_s": 1100.0,
        "wall_s": 50.0,
        "steps_timed": 55,
        "threads": 2,
        "final_loss": 6.0,
    }
    r = {
        "config": "demo-decoder",
        "hf_class": "LlamaForCausalLM",
        "corpus": "demo",
        "steps": 60,
        "batch": 16,
        "seq_len": 128,
        "threads": 2,
        "precision": "fp32",
        "warmup_steps_excluded": 5,
        "hf": side,
        "ours": {**side, "tokens_per_s": 1200.0, "wall_s": 55.0, "time_to_first_step_s": 9.0},
        "tokens_per_s_ratio": 1.2,
        "tokens_per_s_target": 1.0,
        "wall_ratio": 1.1,
        "wall_target": 1.2,
        "meets_targets": True,
    }
    table = bench_vs_hf.format_table(r)
    assert "1.20  target >= 1.0" in table and "1.10  target <= 1.2" in table and "first 5 out" in table
    assert "meets both targets: yes" in table and "alternating" not in table
    table = bench_vs_hf.format_table(
        {**r, "repeats": 2, "paired_tokens_per_s_ratios": [1.25, 1.15], "paired_wall_ratios": [1.05, 1.15]}
    )
    assert "runs: ours 2, Trainer 3 (alternating)" in table and "tokens/s 1.25, 1.15; wall 1.05, 1.15" in table


def test_a_missing_corpus_is_one_line_before_anything_runs(tmp_path):
    from pretrain.config import ConfigError

    with pytest.raises(ConfigError, match="--corpus .* does not exist"):
        bench_vs_hf.vs_hf_bench(ROOT / "configs" / "demo-decoder.yaml", [], corpus=str(tmp_path / "none.txt"))


def test_trainer_side_is_the_mean_of_its_runs_before_and_after_ours():
    a = {"wall_s": 30.0, "tokens_per_s": 4500.0, "best_window_tokens_per_s": 4800.0, "steps": 60, "threads": 2}
    b = {**a, "wall_s": 34.0, "tokens_per_s": 5000.0, "best_window_tokens_per_s": 5200.0}
    side = bench_vs_hf.mean_side([a, b])
    assert (side["wall_s"], side["tokens_per_s"], side["best_window_tokens_per_s"]) == (32.0, 4750.0, 5000.0)
    assert side["steps"] == 60 and side["runs"] == [
        {k: r[k] for k in ("wall_s", "tokens_per_s", "best_window_tokens_per_s")} for r in (a, b)
    ]
    ours = bench_vs_hf.mean_side(
        [{**a, "time_to_first_step_s": 7.0}, {**b, "time_to_first_step_s": 9.0}],
        (*bench_vs_hf.SIDE_KEYS, "time_to_first_step_s", "step_tokens_per_s"),
    )
    assert ours["time_to_first_step_s"] == 8.0 and "step_tokens_per_s" not in ours["runs"][0]  # absent: not averaged


def test_each_run_of_ours_is_paired_with_the_trainer_runs_around_it():
    hf = [{"tokens_per_s": t} for t in (4000.0, 5000.0, 6000.0)]  # drifting up
    ours = [{"tokens_per_s": 4950.0}, {"tokens_per_s": 5500.0}]
    assert bench_vs_hf.paired_ratios(ours, hf, "tokens_per_s") == [4950 / 4500, 5500 / 5500]


def test_repeats_below_one_are_refused():
    from pretrain.config import ConfigError

    with pytest.raises(ConfigError, match="--repeats must be at least 1"):
        bench_vs_hf.vs_hf_bench(ROOT / "configs" / "demo-decoder.yaml", [], corpus="demo", repeats=0)
