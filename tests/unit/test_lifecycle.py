"""The training lifecycle: the run plan, the TrainModule (full state dict, rebuild mid-run) and the event-driven
trainer (ordered callbacks, a new behaviour without editing the loop)."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, load_config, make_plan
from tests.conftest import ROOT
from tests.distributed import run_distributed

DEMO = ROOT / "configs" / "demo-decoder.yaml"


# -- the run plan (fast) ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workers, micro, accum, shares", [
    (1, 16, 1, (16,)), (2, 8, 1, (8, 8)), (3, 2, 3, (6, 6, 4)), (4, 4, 1, (4, 4, 4, 4)), (8, 2, 1, (2,) * 8)])
def test_plan_keeps_the_global_batch_on_any_worker_count(workers, micro, accum, shares):
    cfg = load_config(DEMO, [f"cluster.num_workers={workers}"])  # the default demo, unchanged otherwise
    plan = make_plan(cfg, workers)
    assert (plan.micro_batch, plan.grad_accum, plan.shares) == (micro, accum, shares)
    assert sum(plan.shares) == plan.global_batch == cfg.train.global_batch_size == 16
    assert plan.tokens_per_step == 16 * cfg.model.max_seq_len
    assert sum(plan.val_shares) == cfg.train.val_sequences
    # DeepSpeed's averaging (1/accum per micro-batch, mean over workers) times the scale = mean over real ones.
    assert plan.gradient_scale() * plan.real_micro_batches == workers * plan.grad_accum
    ids = sorted(i for r in range(workers) for i in plan.micro_batch_ids(r))
    assert ids == list(range(plan.real_micro_batches)), "every real micro-batch has one global id"


def test_plan_micro_batch_is_a_cap_and_bad_layouts_name_what_to_set():
    plan = make_plan(load_config(DEMO, ["train.micro_batch_size=4"]), 1)
    assert (plan.micro_batch, plan.grad_accum) == (4, 4)
    plan = make_plan(load_config(DEMO, ["train.micro_batch_size=5"]), 1)
    assert (plan.micro_batch, plan.grad_accum) == (4, 4), "the largest micro-batch within the cap that splits 16"
    with pytest.raises(ConfigError, match=r"^cluster.num_workers: 16 workers but only data.num_streams=8 .*"
                                          r"set data.num_streams to a multiple of 16"):
        load_config(DEMO, ["cluster.num_workers=16"])
    assert "plan: 3 worker(s), global batch 16" in make_plan(load_config(DEMO), 3).describe()
    with pytest.raises(ConfigError, match="^train.val_sequences: 2 is fewer than the 4 workers"):
        load_config(DEMO, ["cluster.num_workers=4", "train.val_sequences=2"])


# -- rebuilding the module mid-run (2 workers, ZeRO-3) ----------------------------------------------------

STEPS, REBUILD_AT = 6, 3


def _small(*extra: str):
    return load_config(None, [
        "model.vocab_size=101", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
        "model.max_seq_len=16", "model.dropout=0.1", "zero.stage=3", "cluster.num_workers=2",
        "train.global_batch_size=8", "train.micro_batch_size=2", "data.num_streams=2", "train.lr=1e-2",
        "train.warmup_steps=1", f"train.max_steps={STEPS}", "train.precision=fp32", *extra])


def _rebuild_worker(rank: int, world: int) -> dict:
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step, step_seed

    torch.set_num_threads(1)
    cfg = _small()
    g = torch.Generator().manual_seed(7)
    data = [(torch.randint(0, 101, (8, 1), generator=g) + torch.arange(16)) % 101 for _ in range(STEPS)]

    def run(rebuild: bool) -> tuple[list[float], list[float], dict]:
        module = build_module(cfg)
        losses, norms = [], []
        for step, ids in enumerate(data):
            if rebuild and step == REBUILD_AT:
                full = module.full_state_dict()
                module.rebuild(cfg, weights=full, optimizer_state=module.optimizer_state())
            shard = ids[rank * 4:(rank + 1) * 4]
            seeds = [step_seed(cfg.train.seed, step, m) for m in module.plan.micro_batch_ids(rank)]
            r = run_step(module, StepInput(step + 1, {"input_ids": shard, "labels": shard},
                                           module.lr_at(step), seeds))
            losses.append(r.loss)
            norms.append(r.grad_norm)
        return losses, norms, module.full_state_dict()

    plain_losses, plain_norms, plain_final = run(False)
    losses, norms, final = run(True)
    return {"plain": plain_losses, "rebuilt": losses, "plain_norms": plain_norms, "norms": norms,
            "same_weights": all(torch.equal(plain_final[k], final[k]) for k in plain_final),
            "keys": sorted(final), "shapes": {k: tuple(v.shape) for k, v in final.items()}}


@pytest.mark.slow
def test_rebuild_mid_run_under_zero3_is_bitwise():
    """2 workers, ZeRO-3, dropout on: rebuilding the module (new DeepSpeed engine) at step 3 on the gathered
    weights and the optimizer state leaves every later loss, gradient norm and the final weights bitwise equal."""
    ranks = run_distributed(_rebuild_worker, 2, timeout=600)
    r0 = ranks[0]
    assert r0["rebuilt"] == r0["plain"] and r0["norms"] == r0["plain_norms"], (r0["plain"], r0["rebuilt"])
    assert r0["same_weights"] and ranks[1]["same_weights"]
    assert r0["rebuilt"][-1] < r0["rebuilt"][0], "it trains"
    # The full state dict is gathered from the ZeRO-3 partitions: full shapes, identical on both ranks.
    assert r0["shapes"]["blocks.0.attn.q_proj.weight"] == (32, 32) and r0["shapes"] == ranks[1]["shapes"]


def _rebuild_without_optimizer_state(rank: int, world: int) -> tuple[float, float]:
    """Rebuild on the same weights with a fresh optimizer: the function is unchanged (same eval loss)."""
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, evaluate, run_step

    torch.set_num_threads(1)
    cfg = _small("model.dropout=0.0", "zero.stage=2")
    module = build_module(cfg)
    ids = (torch.arange(8).view(8, 1) + torch.arange(16)) % 101
    shard = {"input_ids": ids[rank * 4:(rank + 1) * 4], "labels": ids[rank * 4:(rank + 1) * 4]}
    run_step(module, StepInput(1, shard, 1e-2))
    before = evaluate(module, [shard])["val/loss"]
    module.rebuild(weights=module.full_state_dict())
    after = evaluate(module, [shard])["val/loss"]
    # bf16: DeepSpeed casts the module before copying the fp32 masters; given weights keep every bit in them.
    g = torch.Generator().manual_seed(0)  # the same on every rank
    given = {k: v + 1e-4 * torch.randn(v.shape, generator=g) for k, v in module.full_state_dict().items()}
    given["lm_head.weight"] = given["embed_tokens.weight"]  # tied
    masters = {}
    for stage in (0, 1, 2, 3):
        bf16 = build_module(_small("model.dropout=0.0", f"zero.stage={stage}", "train.precision=bf16"), weights=given)
        got = bf16.full_state_dict()
        masters[stage] = max((got[k] - given[k]).abs().max().item() for k in given)
        bf16.engine.destroy()
    return before, after, masters


@pytest.mark.slow
def test_rebuild_with_given_weights_zero2_and_bf16_masters_keep_them_exactly():
    before, after, masters = run_distributed(_rebuild_without_optimizer_state, 2, timeout=600)[0]
    assert before == after
    assert masters == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}, masters


# -- the default demo on 1, 2, 3 and 4 workers -------------------------------------------------------------


@pytest.mark.slow
def test_default_demo_runs_on_1_to_4_workers_through_ray(tmp_path):
    """``./launch.sh train cluster.num_workers=W`` for W = 1-4, as users run it (the CLI, Ray Train on an embedded
    local Ray; one worker with ``cluster.ray_for_one_worker=true``, since by default it trains in the command's
    process — ``tests/test_bench.py`` runs that path), with the demo's global batch 16 and micro-batch cap 16 (3 workers: uneven 6/6/4 shares padded to
    equal passes): every rank runs as a Ray Train worker, none waits for placement (more workers than CPUs take a
    fractional ``cluster.cpus_per_worker``, as the refusal of a whole CPU each says), and the same global batches
    give the same losses up to float rounding."""
    import json
    import math
    import os
    import subprocess

    from tests.conftest import PYTHON, cli_env

    steps = ["train.max_steps=3", "train.log_every=1", "train.val_every=0", "train.val_sequences=12",
             "checkpoint.every_steps=0", "data.tokenizer_train_docs=3000", "stability.plot_at_end=false",
             "tracking.enabled=false"]
    cpus = os.cpu_count() or 1
    finals, tok = {}, []
    for workers in (1, 3, 4, 2):
        share = min(1.0, math.floor(cpus / workers * 100) / 100)
        proc = subprocess.run([PYTHON, "-m", "pretrain", "train", str(DEMO), *steps, *tok,
                               f"cluster.num_workers={workers}", f"cluster.cpus_per_worker={share:g}",
                               *(["cluster.ray_for_one_worker=true"] if workers == 1 else [])],
                              cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        run_dir = Path(proc.stdout.split("checkpoints in ", 1)[1].split()[0])
        ranks = {int(r) for r in re.findall(rf"^\[train\] rank (\d)/{workers} on Ray node", proc.stdout, re.M)}
        assert ranks == set(range(workers)), (workers, proc.stdout[-3000:])
        assert f"plan: {workers} worker(s), global batch 16" in proc.stdout
        assert "waiting for the cluster" not in proc.stdout
        tok = tok or [f"data.tokenizer={run_dir / 'tokenizer'}"]
        finals[workers] = json.loads((run_dir / "summary.json").read_text())
    ref = finals[1]
    assert ref["step"] == 3 and ref["checkpoint"]
    for workers, final in finals.items():
        assert final["step"] == 3 and final["tokens_seen"] == 3 * 16 * 128, workers
        assert abs(final["final_train_loss"] - ref["final_train_loss"]) < 1e-4, (workers, final, ref)
        assert abs(final["val_loss"] - ref["val_loss"]) < 1e-4, (workers, final["val_loss"], ref["val_loss"])


# -- callbacks ---------------------------------------------------------------------------------------------


def test_callbacks_run_in_order_and_early_stop_ends_the_run():
    """The standard callbacks are ordered as documented; EarlyStop (the docs' worked example) asks the trainer
    to stop at the first validation at or below its target, and only before the last step."""
    from types import SimpleNamespace

    from pretrain.train.callbacks.checkpoint import CheckpointCallback
    from pretrain.train.callbacks.early_stop import EarlyStop
    from pretrain.train.callbacks.health import HealthCallback
    from pretrain.train.callbacks.metrics import MetricsLogger
    from pretrain.train.callbacks.speed import SpeedMonitor
    from pretrain.train.callbacks.stability import StabilityCallback
    from pretrain.train.callbacks.stability_report import StabilityReport
    from pretrain.train.callbacks.validation import ValidationCallback
    from pretrain.train.trainer import Trainer

    order = [SpeedMonitor, StabilityCallback, HealthCallback, MetricsLogger, ValidationCallback, EarlyStop,
             CheckpointCallback, StabilityReport]
    assert [c.order for c in order] == sorted(c.order for c in order)

    said = []
    stub = SimpleNamespace(state=SimpleNamespace(step=40), cfg=load_config(DEMO), stop_reason="",
                           progress=SimpleNamespace(say=said.append))
    stub.stop = lambda reason: setattr(stub, "stop_reason", reason)
    EarlyStop(5.0).on_validation(stub, {"val/loss": 5.1})
    assert stub.stop_reason == ""
    EarlyStop(0.0).on_validation(stub, {"val/loss": 0.1})
    assert stub.stop_reason == "", "0 disables"
    EarlyStop(5.0).on_validation(stub, {"val/loss": 4.9})
    assert stub.stop_reason == "train.stop_at_val_loss" and "stopping" in said[0]
    assert Trainer.stop.__doc__  # the trainer offers the same stop() the stub stands in for



def _optimizer_roundtrip(rank: int, world: int, stages: list[int]) -> dict:
    """Rebuild on the gathered weights with a fresh optimizer, then put back the gathered full AdamW moments."""
    from pretrain.train.module import build_module
    from pretrain.train.optimizer_state import gather_moments, load_moments
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randint(0, 101, (8, 1), generator=g) + torch.arange(16)) % 101 for _ in range(STEPS)]
    out = {}
    for stage in stages:
        cfg = _small("model.dropout=0.0", f"zero.stage={stage}")

        def run(mode: str) -> list[float]:
            module = build_module(cfg)
            losses = []
            for step, ids in enumerate(data):
                if mode != "plain" and step == REBUILD_AT:
                    moments = gather_moments(module)
                    assert moments["step"] == REBUILD_AT and moments["exp_avg"]
                    module.rebuild(cfg, weights=module.full_state_dict())
                    if mode == "moments":
                        load_moments(module, moments)
                shard = ids[rank * 4:(rank + 1) * 4]
                losses.append(run_step(module, StepInput(step + 1, {"input_ids": shard, "labels": shard},
                                                         module.lr_at(step))).loss)
            return losses

        out[stage] = (run("plain"), run("moments"), run("fresh"))
    return out


@pytest.mark.slow
def test_full_optimizer_moments_roundtrip_zero_0_to_3():
    """The gathered AdamW moments (what growth.optimizer grow transforms) restore into a fresh engine on every ZeRO
    stage: the following losses equal the uninterrupted run's (and differ with a fresh optimizer)."""
    res = run_distributed(_optimizer_roundtrip, 2, [0, 1, 2, 3], timeout=600)[0]
    for stage, (plain, restored, fresh) in res.items():
        diff = max(abs(a - b) for a, b in zip(plain, restored))
        print(f"ZeRO-{stage}: restored moments max |diff| {diff:.2e}; fresh optimizer "
              f"{max(abs(a - b) for a, b in zip(plain, fresh)):.2e}")
        assert diff < 1e-6, (stage, plain, restored)
        assert max(abs(a - b) for a, b in zip(plain, fresh)) > 1e-4


# -- the trainer: one real run, events recorded -------------------------------------------------------------

RUN = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
       "model.max_seq_len=32", "data.tokenizer_vocab_size=512", "data.tokenizer_train_docs=2000",
       "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=6", "train.warmup_steps=1",
       "train.log_every=1", "train.val_every=2", "train.val_sequences=8", "checkpoint.every_steps=2",
       "cluster.use_ray=false", "stability.plot_at_end=false"]


def test_a_real_run_emits_events_in_order_and_early_stop_and_profiling_are_callbacks(workdir):
    """The real trainer of a 1-worker run with a recording callback added: the documented event order (step hooks
    inside the step, validation and checkpoint inside the step's end, run end last), EarlyStop ending the run at
    its first good validation, ProfilerCallback writing a trace of its steps, RunSummary writing the summary."""
    import gc
    import json

    from mlflow import MlflowClient

    from pretrain import startup_gc
    from pretrain.driver.prepare import prepare_new
    from pretrain.train.trainer import Callback
    from pretrain.train.worker import build_trainer

    class Recorder(Callback):
        order = 1000

        def __init__(self):
            self.events: list[str] = []
            self.gc_on: list[bool] = []

        def on_run_start(self, trainer):
            self.events.append("run_start")

        def on_step_start(self, trainer, step):
            self.events.append(f"step_start {step}")
            self.gc_on.append(gc.isenabled())

        def before_forward(self, module, index):
            self.events.append(f"forward {index}")

        def after_backward(self, module):
            self.events.append("after_backward")

        def before_update(self, module):
            self.events.append("before_update")

        def after_update(self, module):
            self.events.append("after_update")

        def on_step_end(self, trainer, result):
            self.events.append(f"step_end {trainer.state.step}")

        def on_validation(self, trainer, metrics):
            self.events.append(f"validation {trainer.state.step}")

        def on_checkpoint(self, trainer, path):
            self.events.append(f"checkpoint {path.name}")

        def on_run_end(self, trainer, final):
            self.events.append("run_end")

    job = prepare_new(load_config(DEMO, RUN + ["train.stop_at_val_loss=100", "train.profile_at=1",
                                               "train.profile_steps=2"]))
    recorder = Recorder()
    startup_gc.pause()  # as a command's process does: collection resumes after the first step
    try:
        trainer = build_trainer(asdict(job), [recorder])
        names = [type(c).__name__ for c in trainer.callbacks]
        assert names[:2] == ["SpeedMonitor", "ProfilerCallback"] and names[-2:] == ["RunSummary", "Recorder"]
        final = trainer.fit()
    finally:
        startup_gc.resume()
    assert recorder.gc_on == [False, True] and gc.isenabled()
    step = ["forward 0", "forward 1", "after_backward", "before_update", "after_update"]  # grad accum 2
    assert recorder.events == [
        "run_start",
        "step_start 1", *step, "step_end 1",
        "step_start 2", *step, "validation 2", "checkpoint step_00000002", "step_end 2",
        "run_end"], "EarlyStop (val loss <= 100) ends the run after the first validation"
    assert final["step"] == 2 and final["run_id"] == job.run_id and trainer.stop_reason == "train.stop_at_val_loss"
    run_dir = Path(job.run_dir)
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 2
    trace = json.loads((run_dir / "profile" / "rank0_steps1-2.json").read_text())
    assert any("aten::" in e.get("name", "") for e in trace["traceEvents"])
    table = (run_dir / "profile" / "rank0_steps1-2.txt").read_text()
    assert "aten::" in table
    loop = table.split("\n\n")[0]  # the loop's own table first: the window's wall time per range
    for row in ("run_step", "next_batch", "MetricsLogger.on_step_end", "(outside the ranges)"):
        assert f"\n{row} " in loop, row
    # the speed of the loop and the start-up of this worker (built outside a command: from its setup on)
    assert final["loop_tokens_per_s"] > 0 and final["loop_steps_timed"] == 1 and final["loop_window"] == 10
    phases = final["startup_phases_s"]
    assert list(phases) == ["worker_setup", "engine_build", "trainer_setup", "first_batch", "first_step"]
    assert final["time_to_first_step_s"] == pytest.approx(sum(phases.values())) and min(phases.values()) >= 0
    artifacts = {a.path for a in MlflowClient().list_artifacts(job.run_id, "profile")}
    assert artifacts == {"profile/rank0_steps1-2.json", "profile/rank0_steps1-2.txt"}
