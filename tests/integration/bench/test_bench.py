"""``./launch.sh bench --json`` is one JSON object on stdout with the keys the README documents (no timing asserted),
the real training loop's (``python -m pretrain train`` through Ray, as users run it) included."""

from __future__ import annotations

import json

from tests.harness import cli


def test_bench_json_reports_mfu_ratios_compile_cost_layer_drop_speeds_and_the_real_loop(tmp_path):
    proc = cli(
        tmp_path,
        "bench",
        "--json",
        "--no-moe",
        "--layer-drop",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--loop-steps",
        "12",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.num_heads=4",
        "model.max_seq_len=32",
        "train.micro_batch_size=4",
        "data.tokenizer_vocab_size=512",
        "model.vocab_size=512",
        expect=0,
        timeout=600,
    )
    result = json.loads(proc.stdout)  # nothing else on stdout
    for key in (
        "tokens_per_s",
        "bare_pytorch_tokens_per_s",
        "ratio_vs_bare_pytorch",
        "eager_ratio_vs_bare_pytorch",
        "compiled_ratio_vs_bare_pytorch",
        "compile_s",
        "mfu",
        "measured_matmul_peak_tflops",
    ):
        assert isinstance(result[key], float) and result[key] >= 0, key
    assert (
        result["compile_default"] == "no" and result["ratio_vs_bare_pytorch"] == result["eager_ratio_vs_bare_pytorch"]
    )
    assert 0 < result["mfu"] < 1.5
    speeds = result["layer_drop_tokens_per_s"]  # --layer-drop: rates 0, 0.25 and 0.5 in layer mode
    assert set(speeds) == {"0", "0.25", "0.5"} and all(v > 0 for v in speeds.values())
    assert result["layer_drop_speedup"]["0"] == 1.0
    # the real loop: steady-state tokens/s over the step's, and the start-up per phase (adding up)
    assert result["loop_tokens_per_s"] > 0 and result["loop_mean_tokens_per_s"] > 0
    # against the step timed before and again after the loop (the machine's speed drifts over minutes)
    after = result["step_tokens_per_s_after_loop"]
    assert after > 0 and result["loop_step_reference_tokens_per_s"] == (result["tokens_per_s"] + after) / 2
    assert result["loop_vs_step_ratio"] == result["loop_tokens_per_s"] / result["loop_step_reference_tokens_per_s"]
    assert result["loop_steps_timed"] == 12 - 1 - 5  # the first 5 steps are warm-up
    phases = result["time_to_first_step_phases_s"]
    # one worker with nothing for Ray to do trains in the command's process: no Ray phase
    assert list(phases) == [
        "imports",
        "run_preparation",
        "tokenizer",
        "worker_setup",
        "engine_build",
        "trainer_setup",
        "first_batch",
        "first_step",
    ]
    assert result["time_to_first_step_s"] > 0 and min(phases.values()) >= 0
    assert abs(sum(phases.values()) - result["time_to_first_step_s"]) < 1e-6
    for rate, key in ((0.25, "0.25"), (0.5, "0.5")):
        ratio = result["layer_drop_vs_ideal"][key]  # speed-up over the ideal 1 / (1 - rate)
        assert ratio == result["layer_drop_speedup"][key] * (1 - rate) and ratio > 0
