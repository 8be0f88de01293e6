"""The studies as users run them, on a tiny budget (no number of theirs asserted): ``bench --growth``,
``bench --layer-drop --quality`` and ``bench --early-exit`` (without ``--model``) print one JSON object last,
computed from the curves they report, and leave a parent MLflow run whose children are the study's runs, with the
curves and the figure as artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from benchmarks.curves import ahead_from, flops_saving, time_to_loss_speedup
from pretrain.model.early_exit import speedup_bound
from tests.conftest import WIKITEXT
from tests.harness import cli, tiny_model

TINY = [
    *tiny_model(num_kv_heads=2, max_seq_len=32, vocab_size=512),
    "train.global_batch_size=4",
    "data.num_streams=4",
    "train.micro_batch_size=4",
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=2000",
    "train.val_sequences=4",
    "train.warmup_steps=2",
]


def _bench(tmp_path, *args: str, study: str = "study") -> dict:
    keys = {a.split("=")[0] for a in args if "=" in a}
    tiny = [o for o in TINY if o.split("=")[0] not in keys]
    proc = cli(tmp_path, "bench", "--json", "--study-dir", str(tmp_path / study), *args, *tiny, expect=0, timeout=900)
    return json.loads(proc.stdout)


def _children(result: dict) -> tuple[MlflowClient, list]:
    client = _client_of(result)
    parent = client.get_run(result["mlflow"]["parent_run"])
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "study")}
    assert any(p.endswith(".json") for p in artifacts) and any(p.endswith(".png") for p in artifacts), artifacts
    assert parent.info.status == "FINISHED" and {r.info.status for r in runs} == {"FINISHED"}
    return client, runs


def _client_of(result: dict) -> MlflowClient:
    return MlflowClient(tracking_uri=result["mlflow"]["tracking_uri"])


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def test_growth_study_on_a_tiny_budget(tmp_path):
    """On token shards (``./launch.sh tokenize``, a Ray Data job): the studies and in-job growth read them as they
    read text."""
    text = str(WIKITEXT if WIKITEXT.is_file() else "demo")
    shards = tmp_path / "shards"
    cli(tmp_path, "tokenize", text, "--out", str(shards), "--vocab-size", "512", "--workers", "1", timeout=600)
    corpus = f"data.sources=[{{path: {shards}}}]"
    args = ["--growth", "--tokens", "3000", "--seeds", "0"]
    r = _bench(tmp_path, *args, "--recipes", "stack2@10%", "--jobs", "2", corpus)
    assert r["seeds"] == [0] and r["target"]["num_layers"] == 2 and 0 < r["block_flops_share"] < 1
    assert r["budget_tokens"] == 3000 and r["best_recipe"] == "stack2@10%" and r["corpus_epochs_max"] is None
    assert r["tokens_per_param"] == pytest.approx(3000 / r["target_parameters"]) and r["tokens_per_param"] < 1
    curves = r["curves_flops_val_loss"]
    small = f"alone 1x{r['target']['hidden_size']}"
    scratch, grown, alone = (curves[name]["0"] for name in ("scratch", "stack2@10%", small))
    for curve in (scratch, grown, alone):
        assert len(curve) >= 20, "validation at every 1/25 of the budget"
        assert curve[-1][0] == pytest.approx(r["budget_flops"], rel=0.05), "every run spends the budget"
    want = flops_saving(scratch, grown)
    got = r["growth_flops_saving_per_seed"]["stack2@10%"]["0"]
    assert (got is None and want is None) or got == pytest.approx(want, abs=1e-4)
    assert r["growth_flops_saving"]["stack2@10%"] == got
    assert r["growth_flops_saving_mean_curve"]["stack2@10%"] == got, "one seed: its own curves"
    # against the small model alone (JSON curves are rounded to 6 digits)
    assert r["small_models"] == {"stack2@10%": small}
    assert r["small_alone_final_loss"]["stack2@10%"]["0"] == pytest.approx(alone[-1][1], rel=1e-5)
    assert r["target_ahead_of_small"]["0"] == (r["final_loss"]["scratch"]["0"] < r["final_loss"][small]["0"])
    best_alternative = min(scratch[-1][1], alone[-1][1])
    assert r["grown_vs_best_alternative"]["0"] == pytest.approx(grown[-1][1] - best_alternative, abs=1e-5)
    assert [row["model"] for row in r["iso_flop"]] == ["scratch", small]
    small_row = r["iso_flop"][1]
    assert small_row["tokens"] > r["iso_flop"][0]["tokens"] == pytest.approx(3000)
    ahead = ahead_from(scratch, alone)
    assert small_row["target_ahead_from"]["0"] == (None if ahead is None else pytest.approx(ahead / r["budget_flops"]))
    copying = r["in_context_copying"]  # every run's final model, from its checkpoints
    assert set(copying) == {"scratch", "stack2@10%", small} and all(set(c) == {"0"} for c in copying.values())
    assert all(c["0"]["gain"] == pytest.approx(c["0"]["first_copy"] - c["0"]["second_copy"]) for c in copying.values())
    client, runs = _children(r)
    assert len(runs) == 3, "scratch, the recipe and its small model alone"
    for run in runs:
        assert [a.path for a in client.list_artifacts(run.info.run_id, "study")] == ["study/curves.json"]
        config = Path(client.download_artifacts(run.info.run_id, "config/config.yaml", str(tmp_path)))
        assert str(shards) in config.read_text(), "trained from the shards"
    # side by side (--jobs 2, each run on one CPU) or one at a time on both: the same losses, bit for bit
    one = _bench(tmp_path, *args, "--scan", "--recipes", "stack2@10%", "--jobs", "1", corpus, study="one-at-a-time")
    assert one["jobs"] == 1 and r["jobs"] == 2
    ids = {name: (r["run_ids"][name]["0"], one["run_ids"][name]["0"]) for name in ("scratch", small)}
    for side_by_side, alone_ in ids.values():
        for key in ("val/loss", "train/loss"):
            assert _history(client, side_by_side, key) == _history(_client_of(one), alone_, key), key
    # extended by a recipe and the saving's check: the runs it already has are read from the first study's store
    args = [*args, "--recipes", "stack2@10%,stack2@5%", "--check-saving", "0.25"]
    again = _bench(tmp_path, *args, "--reuse", str(tmp_path / "study"), corpus, study="again")
    reused = {label: ref["run_id"] for label, ref in again["reused_runs"].items()}
    assert reused == {f"{name} seed 0": r["run_ids"][name]["0"] for name in ("scratch", "stack2@10%", small)}
    for name in ("scratch", "stack2@10%", small):
        assert again["curves_flops_val_loss"][name] == curves[name]
        assert again["in_context_copying"][name] == copying[name], "the reused run's model, from its checkpoints"
    _, trained = _children(again)
    names = ["stack2@5% seed 0", "stack2@10% on 75% seed 0", "stack2@5% on 75% seed 0"]
    assert sorted(run.info.run_name for run in trained) == sorted(names), "the new recipe and the checks train"
    check = again["saving_checked"]
    assert check["share_saved"] == 0.25 and check["budget_flops"] == pytest.approx(0.75 * r["budget_flops"])
    for name in ("stack2@10%", "stack2@5%"):
        short = again["curves_flops_val_loss"][f"{name} on 75%"]["0"]
        assert short[-1][0] == pytest.approx(0.75 * r["budget_flops"], rel=0.05), "its own, shorter budget"
        assert check["final_loss"][name]["0"] == pytest.approx(short[-1][1], rel=1e-5)
        assert check["reaches_scratch"][name]["0"] == (check["final_loss"][name]["0"] <= scratch[-1][1] + 1e-5)


def test_layer_drop_study_on_a_tiny_budget(tmp_path):
    """After a growth study's iso-FLOP scan on the same budget: its ``scratch`` and 2-block ``alone`` runs are the
    layer-dropout study's ``no-drop`` and equal-FLOPs half-depth runs (one config), read from its store; the
    reused no-drop model is pruned and evaluated from its checkpoint."""
    corpus = f"data.sources=[{{path: {WIKITEXT if WIKITEXT.is_file() else 'demo'}}}]"
    same = ["--tokens", "1024", "--seeds", "0", "model.num_layers=4", corpus]
    # in process, one at a time: side by side is the growth test's (spawned processes cost start-up here)
    scan = _bench(tmp_path, "--growth", "--scan", "--recipes", "stack2@10%", "--jobs", "1", *same, study="scan")
    alone = scan["small_models"]["stack2@10%"]
    scan_runs = sorted((tmp_path / "scan").glob("*/*/checkpoints/*"))
    assert len(scan_runs) == 2, "scratch and the 2-block model alone"
    r = _bench(tmp_path, "--layer-drop", "--quality", "--reuse", str(tmp_path / "scan"), *same)
    assert sorted((tmp_path / "scan").glob("*/*/checkpoints/*")) == scan_runs, "the pruned no-drop model is the study's"
    reused = {label: ref["run_id"] for label, ref in r["reused_runs"].items()}
    assert reused == {
        "no-drop seed 0": scan["run_ids"]["scratch"]["0"],
        "half-depth equal FLOPs seed 0": (scan["run_ids"][alone]["0"]),
    }
    assert r["model"]["num_layers"] == 4 and r["steps"]["pld"] >= r["steps"]["no-drop"]
    assert r["budget_tokens"] == 128 * r["steps"]["no-drop"] >= 1024, "128 tokens a step, the budget's FLOPs spent"
    assert r["tokens_per_param"] == pytest.approx(r["budget_tokens"] / r["parameters"])
    steps = r["steps"]
    assert steps["half-depth"] <= steps["no-drop"] <= steps["half-depth, equal FLOPs"]
    row = r["per_seed"]["0"]
    final, flops = row["final_val_loss"], row["curves_flops"]
    assert (
        row["depth_pays"] == (final["no-drop"] < final["half-depth, equal FLOPs"])
        and r["depth_pays"] == row["depth_pays"]
    )
    assert flops["half-depth, equal FLOPs"][-1][0] == pytest.approx(flops["no-drop"][-1][0], rel=0.1), "equal FLOPs"
    curves = row["curves_seconds"]
    assert row["pld_time_to_loss_speedup"] == time_to_loss_speedup(curves["no-drop"], curves["pld"])
    assert row["pruned_vs_scratch_half_depth_gap"] == row["pruned_loss"]["layer-drop"] - row["half_depth_scratch_loss"]
    assert r["pruned_vs_scratch_half_depth_gap"] == row["pruned_vs_scratch_half_depth_gap"]
    assert set(r["goals"].values()) <= {True, False}
    assert final["no-drop"] == pytest.approx(scan["final_loss"]["scratch"]["0"], rel=1e-5)
    assert final["half-depth, equal FLOPs"] == pytest.approx(scan["final_loss"][alone]["0"], rel=1e-5)
    assert row["pruned_loss"]["no-drop"] > 0 and row["full_loss"]["no-drop"] > 0, "read from the scan's checkpoint"
    _, runs = _children(r)
    assert sorted(run.info.run_name for run in runs) == ["half-depth seed 0", "layer-drop 0.5 seed 0", "pld seed 0"]


def test_early_exit_study_on_a_tiny_budget(tmp_path):
    corpus = f"data.sources=[{{path: {WIKITEXT if WIKITEXT.is_file() else 'demo'}}}]"
    args = ["--early-exit", "--tokens", "2048", "--prompts", "3", "--prompt-tokens", "4", "--max-new-tokens", "5"]
    scale = "layer_drop.early_exit.scale=0.5"  # the recipe's: the early-exit run's alone
    r = _bench(tmp_path, *args, "--cli-prompts", "1", "--jobs", "1", "model.num_layers=4", corpus, scale)
    assert r["recipe"][-1] == scale and "layer_drop.early_exit.scale=1.0" not in r["recipe"]
    assert r["jobs"] == 1 and r["model"]["num_layers"] == 4 and r["tokens"]["baseline"] >= 2048 - r["tokens_per_step"]
    steps, arithmetic = r["steps"], r["early_exit_flops"]
    # equal FLOPs: the early-exit run trains exit 2 every other step (rotational, exits every:2) and skips blocks
    assert arithmetic["exits_per_step"] == pytest.approx(0.5, abs=0.5 / steps["early-exit"])
    assert arithmetic["exit_head_flops_per_token"] == 6 * r["vocab_size"] * r["model"]["hidden_size"]
    assert steps["early-exit"] < steps["baseline"]
    assert arithmetic["flops"] == pytest.approx(r["budget_flops"], rel=1.0 / steps["early-exit"])
    final = r["final_val_loss"]
    assert r["loss_gap"] == pytest.approx(final["early-exit"] - final["baseline"])
    assert final["baseline"] == pytest.approx(r["curves_step_share_val_loss"]["baseline"][-1][1])
    assert list(r["exit_curves_step_share_loss_acceptance"]) == ["2"], "validation scores the trained exits"
    assert all(0 <= a <= 1 for _, _, a in r["exit_curves_step_share_loss_acceptance"]["2"])
    bound, acc = r["speedup_bounds"]["2"], r["exit_curves_step_share_loss_acceptance"]["2"][-1][2]
    assert bound == speedup_bound(acc, 2, 4), "from the exit's final acceptance"
    copying = r["in_context_copying"]  # both final models, the reused-or-trained baseline's read from its run
    assert set(copying) == {"baseline", "early-exit"} and copying["baseline"] != copying["early-exit"]
    assert all(c["gain"] == pytest.approx(c["first_copy"] - c["second_copy"]) for c in copying.values())
    d = r["decoding"]
    assert d["prompts"] == 3 and set(d["exits"]) == {"1", "2", "3"} and d["draft_tokens"] == 4
    for t in d["exits"].values():  # lossless under greedy decoding, whatever the model learned
        assert t["identical"] and t["identical_prompts"] == 3 and 0 <= t["acceptance"] <= 1
    assert d["cli"]["prompts"] == 1 and d["cli"]["identical"] and d["cli"]["same_as_in_process"]
    assert d["cli"]["early_exit"] == d["best_exit"]
    assert set(r["goals"].values()) <= {True, False}
    _, runs = _children(r)
    params = {run.data.tags["study.variant"]: run.data.params for run in runs}
    assert set(params) == {"baseline seed 0", "early-exit seed 0"}
    assert params["early-exit seed 0"]["layer_drop.early_exit.scale"] == "0.5"
    assert params["baseline seed 0"]["layer_drop.early_exit.layers"] == "", "the baseline is the run without"
    assert params["baseline seed 0"]["layer_drop.early_exit.scale"] == "1.0", "a recipe override stays out of it"
    # again, both runs read from the first study's store: the models from their checkpoints, decoded the same
    reuse = ["--reuse", str(tmp_path / "study")]
    again = _bench(tmp_path, *args, *reuse, "--cli-prompts", "0", "model.num_layers=4", corpus, scale, study="again")
    assert set(again["reused_runs"]) == {"baseline seed 0", "early-exit seed 0"}
    assert again["final_val_loss"] == final and again["in_context_copying"] == copying
    for e, t in again["decoding"]["exits"].items():
        assert t["identical"] and t["acceptance"] == d["exits"][e]["acceptance"], e
