"""``bench --early-exit --model HF_DIR`` as a user runs it, tiny: prompts from the held-out data the export carries,
every exit's outputs identical to plain greedy, acceptance within [0, 1], and the best exit through
``./launch.sh generate`` giving the in-process greedy text (no number of the benchmark's asserted)."""

from __future__ import annotations

import json

from pretrain.config import to_dict
from pretrain.export.hf import export_model
from tests.harness import cli
from tests.unit.eval.test_generate import LAYERS
from tests.unit.export.test_hf import LLAMA_CFG, one_thread, perturbed_state, small_run_config  # noqa: F401


def test_bench_early_exit_tiny(tokenizer_dir, tokenizer, tmp_path, capsys):
    model = [f"model.{k}={v}" for k, v in LLAMA_CFG.items()]
    cfg = small_run_config(tmp_path, tokenizer_dir, [*model, f"model.num_layers={LAYERS}"])
    meta = {"data": to_dict(cfg.data), "seed": cfg.train.seed, "max_seq_len": cfg.model.max_seq_len}
    export_model(cfg.model, perturbed_state(cfg.model), tokenizer, tmp_path / "hf", metadata=meta, log=lambda *a: None)
    args = ["--model", str(tmp_path / "hf"), "--prompts", "4", "--prompt-tokens", "6", "--max-new-tokens", "8"]
    proc = cli(tmp_path, "bench", "--early-exit", *args, "--draft-tokens", "3", "--cli-prompts", "1", "--json")
    r = json.loads(proc.stdout)
    assert r["hf_class"] == "LlamaForCausalLM" and r["layers"] == LAYERS and r["prompts"] == 4
    assert set(r["exits"]) == {str(e) for e in range(1, LAYERS)}
    for t in r["exits"].values():
        assert t["identical"] and t["identical_prompts"] == 4 and 0 <= t["acceptance"] <= 1
    assert r["best_exit"] in range(1, LAYERS)
    assert r["cli"]["prompts"] == 1 and r["cli"]["identical"] and r["cli"]["same_as_in_process"]
    from pretrain.cli import main  # the table, in-process (the same entry point)

    assert main(["bench", "--early-exit", *args, "--exits", "2", "--cli-prompts", "0"]) == 0
    table = capsys.readouterr().out
    assert "plain greedy" in table and "exit 2" in table and "best exit: 2" in table
