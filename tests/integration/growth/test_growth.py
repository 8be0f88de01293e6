"""Growth in running jobs on real gloo workers (a ``growth.schedule`` under every ZeRO stage, encoder, decoder and
upcycling; bitwise resume across growths) and through the CLI (``grow``, then resume, export and lineage)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pretrain.config import load_config
from tests.harness import cli, metric_history, run_jobs, tiny_model

# -- in a running job ------------------------------------------------------------------------------------------

GROW = [
    *tiny_model(num_kv_heads=2, max_seq_len=32, vocab_size=None),
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=3000",
    "data.num_streams=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=8",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_sequences=8",
    "checkpoint.every_steps=2",
    "cluster.num_workers=2",
    "cluster.use_ray=false",
    "stability.plot_at_end=false",
    "growth.rewarm_steps=2",
    "growth.schedule=[{at_step: 2, depth: 2x, depth_op: identity, noise: 0}, "
    "{at_step: 4, width: 2x, noise: 0}, {at_step: 6, depth: '+1', depth_op: stack}]",
]


@pytest.mark.parametrize("stage", [3])
def test_growth_schedule_in_a_running_job(tmp_path, stage):
    """2 workers under ZeRO-{stage}, optimizer moments grown with the weights: identity depth growth at step 2 and
    tiled width growth at step 4 (both exact: the held-back loss is unchanged), then a stacked depth growth; the data
    stream continues; a run stopped at step 3 (between the growths) and resumed reproduces the uninterrupted losses
    bitwise, also on one worker after the last growth; the final checkpoint records the grown architecture.

    The growth points and the run's length are given as a user gives a budget: the first in tokens, the last as a
    fraction of ``train.max_flops``, which derives ``max_steps``. ``train/flops`` counts each stage at its size
    (resumed too) and validation comes each ``train.val_every_flops``."""
    from pathlib import Path

    import yaml

    from pretrain.cli import main
    from pretrain.driver.budget import run_flops
    from pretrain.driver.prepare import prepare_new
    from tests.conftest import ROOT, in_workdir

    cfg_path = ROOT / "configs" / "demo-decoder.yaml"
    opts = GROW + [f"zero.stage={stage}", "growth.optimizer=grow", "model.vocab_size=512"]  # moments grown too
    planned = load_config(cfg_path, opts)
    budget, at_6 = run_flops(planned), run_flops(planned, 6)
    opts += [
        "growth.schedule=[{at_tokens: 512, depth: 2x, depth_op: identity, noise: 0}, {at_step: 4, width: 2x, "
        f"noise: 0}}, {{at_fraction: {(at_6 - 1) / (budget - 1)!r}, depth: '+1', depth_op: stack}}]",
        f"train.max_flops={budget - 1!r}",
        "train.max_steps=1000",  # derived from the budget
        f"train.val_every_flops={budget / 3!r}",
    ]
    with in_workdir(tmp_path):
        full = prepare_new(load_config(cfg_path, opts))
        tok = [f"data.tokenizer={Path(full.run_dir) / 'tokenizer'}"]
        part = prepare_new(load_config(cfg_path, opts + tok + ["faults.stop_after_step=3"]))
        run_jobs(2, [full, part], fresh=False)
        resumed = dataclasses.replace(part, config={**part.config})
        resumed.config["faults"] = {**resumed.config["faults"], "stop_after_step": 7}
        run_jobs(2, [resumed])
        resumed.config["faults"] = {**resumed.config["faults"], "stop_after_step": -1}
        resumed.config["cluster"] = {**resumed.config["cluster"], "num_workers": 1}
        run_jobs(1, [resumed])
        ref, got = metric_history(full.run_id, "train/loss"), metric_history(part.run_id, "train/loss")
        assert sorted(ref) == list(range(1, 9))
        assert all(got[s] == ref[s] for s in range(1, 8)), (ref, got)  # 2 workers, across growths and resumes
        assert abs(got[8] - ref[8]) < 1e-4, "step 8 on one worker: the same global batch"
        before, after = (
            metric_history(full.run_id, "growth/loss_before"),
            metric_history(full.run_id, "growth/loss_after"),
        )
        assert sorted(before) == [2, 4, 6]
        for s in (2, 4):
            assert after[s] == pytest.approx(before[s], rel=1e-5), s
        rebuilt = metric_history(full.run_id, "growth/loss_rebuilt")  # through the rebuilt ZeRO engine itself
        assert sorted(rebuilt) == [2, 4, 6] and all(rebuilt[s] == pytest.approx(after[s], rel=1e-4) for s in rebuilt)
        saved = yaml.safe_load((Path(full.run_dir) / "step_00000008" / "config.yaml").read_text())
        assert (saved["model"]["num_layers"], saved["model"]["hidden_size"], saved["model"]["num_heads"]) == (5, 64, 8)
        assert not saved["model"]["tie_embeddings"], "width growth unties the embeddings"
        small = yaml.safe_load((Path(full.run_dir) / "step_00000002" / "config.yaml").read_text())
        assert small["model"]["num_layers"] == 2, "the checkpoint before a growth keeps the old architecture"
        lr = metric_history(full.run_id, "train/lr")
        assert lr[3] < lr[4] and lr[5] < lr[6], "the LR re-warms after each growth"
        assert full.config["train"]["max_steps"] == 8
        assert [e["at_step"] for e in full.config["growth"]["schedule"]] == [2, 4, 6]
        flops = metric_history(full.run_id, "train/flops")
        assert all(flops[s] == pytest.approx(run_flops(planned, s), rel=1e-12) for s in range(1, 9))
        assert metric_history(part.run_id, "train/flops") == flops, "counted across the stop and the resumes"
        val_at = metric_history(full.run_id, "val/flops")
        every = budget / 3
        expected = [s for s in range(1, 9) if flops[s] // every > flops.get(s - 1, 0.0) // every or s == 8]
        assert sorted(val_at) == expected and len(expected) == 3, (val_at, expected)
        # the config the run was created from forks from its checkpoints as it is (`train CONFIG
        # checkpoint.resume_from=DIR`): its growth points are the ones the run resolved; at a growth's step the
        # checkpoint is the model before it
        for step in (2, 4, 6):
            ckpt = Path(full.run_dir) / f"step_{step:08d}"
            fork = [str(cfg_path), *opts, *tok, f"checkpoint.resume_from={ckpt}", "--dry-run"]
            assert main(["train", *fork]) == 0, step


def test_growth_on_every_zero_stage_encoder_decoder_and_upcycling_keeps_the_data_stream(tmp_path):
    """2 workers, one pair of processes: the decoder schedule (identity depth, tiled width, stacked depth, moments
    grown) under ZeRO-1 and ZeRO-2 (ZeRO-3: the test above) gives the same losses on both; an encoder (post-norm,
    learned positions) grows by stacking and tiled width under ZeRO-1 and ZeRO-3; a decoder under ZeRO-2 is
    upcycled to 4 experts with expert parallelism 2, and resumes after the growth bitwise (from the checkpoint's
    expert-parallel layout). Every exact growth keeps the held-back loss, and the data
    position after the growths is exactly that of the same run without growth (no document repeated or skipped)."""
    import json
    from pathlib import Path

    import yaml
    from mlflow import MlflowClient

    from pretrain.driver.prepare import prepare_new
    from tests.conftest import ROOT, in_workdir

    dec_cfg, enc_cfg = ROOT / "configs" / "demo-decoder.yaml", ROOT / "configs" / "demo-encoder.yaml"
    dec = GROW + ["train.max_steps=7", "growth.optimizer=grow"]
    base = [o for o in GROW if not o.startswith(("growth.schedule", "model.num_kv_heads"))] + ["train.max_steps=7"]
    enc = base + [
        "growth.optimizer=grow",
        "growth.schedule=[{at_step: 2, depth: 2x}, {at_step: 4, width: 2x, noise: 0}]",
    ]
    moe = base + ["zero.stage=2", "parallel.expert=2", "growth.schedule=[{at_step: 3, experts: 4, top_k: 2, noise: 0}]"]
    with in_workdir(tmp_path):
        jobs = {"dec1": prepare_new(load_config(dec_cfg, dec + ["zero.stage=1"]))}
        tok = [f"data.tokenizer={Path(jobs['dec1'].run_dir) / 'tokenizer'}"]
        jobs["dec2"] = prepare_new(load_config(dec_cfg, dec + tok + ["zero.stage=2"]))
        jobs["plain"] = prepare_new(load_config(dec_cfg, [o for o in dec if not o.startswith("growth.schedule")] + tok))
        jobs["enc1"] = prepare_new(load_config(enc_cfg, enc + ["zero.stage=1"]))
        jobs["enc3"] = prepare_new(load_config(enc_cfg, enc + ["zero.stage=3"]))
        jobs["moe"] = prepare_new(load_config(dec_cfg, moe))
        moe_tok = [f"data.tokenizer={Path(jobs['moe'].run_dir) / 'tokenizer'}"]
        stopped = prepare_new(load_config(dec_cfg, moe + moe_tok + ["faults.stop_after_step=5"]))
        finals = run_jobs(2, [*jobs.values(), stopped], fresh=False)[0][: len(jobs)]
        # the upcycled run resumed after its growth: expert-parallel from the checkpoint's layout, as it was
        resumed = {**stopped.config, "faults": {**stopped.config["faults"], "stop_after_step": -1}}
        run_jobs(2, [dataclasses.replace(stopped, config=resumed)])
        client = MlflowClient()

        def history(name, key):
            return {x.step: x.value for x in client.get_metric_history(jobs[name].run_id, key)}

        def saved(name, part):
            return yaml.safe_load((Path(jobs[name].run_dir) / "step_00000007" / "config.yaml").read_text())[part]

        assert all(f["step"] == 7 for f in finals)
        for name, exact in (("dec1", (2, 4)), ("dec2", (2, 4)), ("enc1", (4,)), ("enc3", (4,)), ("moe", (3,))):
            b, a = history(name, "growth/loss_before"), history(name, "growth/loss_after")
            for s in exact:
                assert a[s] == pytest.approx(b[s], rel=1e-5), (name, s, "an exact growth keeps the loss")
        l1, l2 = history("dec1", "train/loss"), history("dec2", "train/loss")
        assert sorted(l1) == list(range(1, 8)) and all(l2[s] == pytest.approx(l1[s], rel=1e-5) for s in l1), (l1, l2)
        assert (saved("dec1", "model")["num_layers"], saved("dec1", "model")["hidden_size"]) == (5, 64)
        for name in ("enc1", "enc3"):
            assert (saved(name, "model")["num_layers"], saved(name, "model")["hidden_size"]) == (4, 64)
        assert history("enc3", "train/loss")[7] == pytest.approx(history("enc1", "train/loss")[7], rel=1e-4)
        assert saved("moe", "moe")["num_experts"] == 4 and saved("moe", "parallel")["expert"] == 2
        ref, got = history("moe", "train/loss"), metric_history(stopped.run_id, "train/loss")
        assert sorted(got) == list(range(1, 8)) and all(got[s] == ref[s] for s in ref), (ref, got)
        assert "moe/block0/max_share" in client.get_run(jobs["moe"].run_id).data.metrics

        def data_state(name):
            ckpt = Path(jobs[name].run_dir) / "step_00000007" / "data"
            return [json.loads(f.read_text()) for f in sorted(ckpt.glob("rank_*.json"))]

        grown, plain = data_state("dec1"), data_state("plain")
        assert grown == plain and sum(st["streams"][s]["sequences"] for st in grown for s in st["streams"]) == 7 * 8


def test_identity_depth_growth_of_a_rho_linear_run_keeps_the_loss_in_the_job_and_offline(tmp_path):
    """``layer_drop.scaling: rho`` with ``by_depth: linear`` (rate 0.8: rho 0.6, 0.2 at depth 2, 0.8, 0.6, 0.4, 0.2
    at depth 4): identity depth growth keeps the held-back loss in the job (``growth.schedule``, checked by the run
    itself and logged) and with ``grow`` on the committed checkpoint; the same growth with rho recomputed for the
    new depth (the weights not rescaled) moves the loss on the same batch past the growth check's tolerance."""

    from mlflow import MlflowClient

    from pretrain.config import GrowthStep
    from pretrain.driver.grow import _held_back_batch
    from pretrain.export.checkpoints import resolve_checkpoint
    from pretrain.model.growth import apply_growth
    from pretrain.train.callbacks.growth import grown_config, held_back_loss
    from tests.conftest import ROOT, in_workdir

    def run(*args):
        proc = cli(tmp_path, *args, expect=0, timeout=600)
        return proc.stdout

    rho = ["layer_drop.rate=0.8", "layer_drop.scaling=rho", "layer_drop.by_depth=linear", "train.lr=1e-2"]
    base = (
        [o for o in GROW if not o.startswith("growth.")]
        + rho
        + [
            "train.max_steps=4",
            "cluster.num_workers=1",
            "checkpoint.every_steps=4",
            "growth.schedule=[{at_step: 2, depth: 2x, depth_op: identity, noise: 0}]",
        ]
    )
    out = run("train", str(ROOT / "configs" / "demo-decoder.yaml"), *base)
    parent = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("MLflow run id"))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    m = client.get_run(parent).data.metrics
    print(f"in the job: {m['growth/loss_before']:.6f} -> {m['growth/loss_after']:.6f}")
    assert m["growth/loss_after"] == pytest.approx(m["growth/loss_before"], rel=2e-6)
    out = run("grow", parent, "depth=2x", "depth_op=identity", "noise=0")
    child = next(line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith("[grow] new run"))
    m = client.get_run(child).data.metrics
    print(f"offline: {m['growth/loss_before']:.6f} -> {m['growth/loss_after']:.6f}")
    assert m["growth/loss_after"] == pytest.approx(m["growth/loss_before"], rel=2e-6)
    assert "8 blocks" in out
    with in_workdir(tmp_path):  # the plain operator, rho recomputed for the child's depth: what must not happen
        ckpt = resolve_checkpoint(parent)  # the latest committed checkpoint of the run (step 4)
        cfg, sd = ckpt.config, ckpt.state_dict(inference=False)
        plain = apply_growth(cfg.model, cfg.moe, sd, GrowthStep(depth="2x", depth_op="identity", noise=0.0), seed=0)
        batch = [_held_back_batch(ckpt)]
        stale = held_back_loss(grown_config(cfg, plain.model, plain.moe), plain.state, batch, torch.device("cpu"))
    rel = abs(stale - m["growth/loss_before"]) / m["growth/loss_before"]
    print(f"offline without the fold: {m['growth/loss_before']:.6f} -> {stale:.6f} (relative {rel:.1e})")
    assert rel > cfg.growth.check_tolerance, "the scales matter"


def test_offline_grow_then_resume_keeps_improving_exports_and_upcycles(tmp_path):
    """The README's sequence as a user runs it: the demo decoder at 128 wide, trained 20 steps by 2 workers under
    ZeRO-3 (no Ray: torchrun; partitioned weights merged), to the end of its LR warm-up; `grow depth=2x
    depth_op=identity width=2x width_op=tile noise=0` (exact: the held-back loss is unchanged, logged) makes a child
    MLflow run tagged with its parent, which `runs` shows; `resume CHILD` on 1 worker for 10 steps continues the
    parent's step count and data. The child starts with fresh AdamW moments: it re-warms its LR
    (`growth.rewarm_steps`, recorded in its config), and its validation loss after the 10 steps is not above its
    parent's at the growth point. It exports with a passing parity check. `grow experts=4` upcycles the parent; the
    child (written on 1 process) trains with expert parallelism on 2 Ray workers (parallel.expert=2) and its EP=2
    checkpoint exports as Mixtral."""
    import json

    import yaml
    from mlflow import MlflowClient

    from tests.conftest import ROOT

    def run(*args, ranks=1):
        proc = cli(tmp_path, *args, expect=0, timeout=900, ranks=ranks)
        return proc.stdout

    def new_run(out: str, what: str) -> str:
        return next(line.split()[3].rstrip(":") for line in out.splitlines() if line.startswith(f"[{what}] new run"))

    parent_opts = [
        "model.max_seq_len=64",
        "model.hidden_size=128",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.max_steps=20",
        "train.val_every=20",
        "train.val_sequences=16",
        "train.log_every=1",
        "checkpoint.every_steps=20",
        "cluster.num_workers=2",
        "cluster.use_ray=false",
        "zero.stage=3",
        "zero.param_persistence_threshold=0",
        "data.tokenizer_train_docs=3000",
        "data.num_streams=2",
        "stability.plot_at_end=false",
    ]
    out = run("train", str(ROOT / "configs" / "demo-decoder.yaml"), *parent_opts, ranks=2)  # 2 ranks: torchrun
    assert "plan: 2 worker(s)" in out
    parent = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("MLflow run id"))
    child = new_run(
        run("grow", parent, "depth=2x", "depth_op=identity", "width=2x", "width_op=tile", "noise=0"), "grow"
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    tags = client.get_run(child).data.tags
    assert tags["growth.parent_run_id"] == parent and tags["growth.parent_step"] == "20"
    assert tags["mlflow.parentRunId"] == parent and "depth 4->8 identity" in tags["growth.operator"]
    m = client.get_run(child).data.metrics
    assert m["growth/loss_after"] == pytest.approx(m["growth/loss_before"], rel=1e-5)
    assert f"growth of run {parent} at step 20" in run("runs", child)
    assert f"^ growth of run {parent}" in run("runs")
    run_dir = next(p for p in tmp_path.rglob(child) if p.is_dir() and (p / "config.yaml").exists())
    parent_dir = next(p for p in tmp_path.rglob(parent) if p.is_dir() and (p / "config.yaml").exists())
    flops = [
        json.loads((d / "step_00000020" / "trainer_state.json").read_text())["flops"] for d in (parent_dir, run_dir)
    ]
    assert flops[1] == flops[0] > 0, "the child carries the parent's FLOPs (not its steps recounted at its size)"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["growth"]["rewarm_steps"] == 20, "a grown run re-warms (the parent's warm-up), recorded in its config"
    run("resume", child, "train.max_steps=30", "train.val_every=10", "cluster.num_workers=1")

    def history(run_id, key):
        return {x.step: x.value for x in client.get_metric_history(run_id, key)}

    assert sorted(history(child, "train/loss")) == list(range(21, 31)), "the parent's step count and data go on"
    parent_val, child_val = history(parent, "val/loss")[20], history(child, "val/loss")[30]
    assert child_val <= parent_val, (parent_val, child_val, history(child, "train/loss"), history(child, "train/lr"))
    report = run("export", child, "--out", str(tmp_path / "hf_grown"))
    assert "LlamaForCausalLM" in report and "parity" in report
    cfg = json.loads((tmp_path / "hf_grown" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["tie_word_embeddings"]) == (8, 256, False)

    upcycled = run("grow", parent, "experts=4", "noise=0")
    assert "[grow] warning: noise=0 upcycles into identical experts" in upcycled
    moe_child = new_run(upcycled, "grow")
    # the upcycled child (written on 1 process) trains with expert parallelism on 2 Ray workers
    out = run(
        "resume",
        moe_child,
        "train.max_steps=22",
        "cluster.use_ray=true",
        "cluster.num_workers=2",
        "parallel.expert=2",
        "zero.stage=1",
    )
    assert "2 worker(s)" in out
    hist = {x.step for x in client.get_metric_history(moe_child, "train/loss")}
    assert hist == {21, 22} and client.get_metric_history(moe_child, "moe/block0/expert3_tokens")
    report = run("export", moe_child, "--out", str(tmp_path / "hf_moe"))  # its EP=2 checkpoint
    assert "MixtralForCausalLM" in report
