"""The training lifecycle in one process (``pretrain/train/worker.py``: ``build_trainer``, ``train_loop``): the
event-driven trainer (ordered callbacks, a new behaviour without editing the loop); the run plan is in
``tests/unit/config/test_plan.py``. The TrainModule on real gloo ranks and the demo on 1-4 Ray workers are in
``tests/integration/train/test_lifecycle.py``."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from pretrain.config import load_config
from tests.conftest import ROOT
from tests.harness import tiny_model

DEMO = ROOT / "configs" / "demo-decoder.yaml"


# -- callbacks ---------------------------------------------------------------------------------------------


def test_callbacks_run_in_order_and_early_stop_ends_the_run():
    """The standard callbacks are ordered as documented; EarlyStop (the docs' worked example) asks the trainer
    to stop at the first validation at or below its target, and only before the last step."""
    from types import SimpleNamespace

    from pretrain.train.callbacks.checkpoint import CheckpointCallback
    from pretrain.train.callbacks.health import HealthCallback
    from pretrain.train.callbacks.metrics import MetricsLogger
    from pretrain.train.callbacks.speed import SpeedMonitor
    from pretrain.train.callbacks.stability import StabilityCallback, StabilityReport
    from pretrain.train.callbacks.stopping import EarlyStop
    from pretrain.train.callbacks.validation import ValidationCallback
    from pretrain.train.trainer import Trainer

    order = [
        SpeedMonitor,
        StabilityCallback,
        HealthCallback,
        MetricsLogger,
        ValidationCallback,
        EarlyStop,
        CheckpointCallback,
        StabilityReport,
    ]
    assert [c.order for c in order] == sorted(c.order for c in order)

    said = []
    stub = SimpleNamespace(
        state=SimpleNamespace(step=40), cfg=load_config(DEMO), stop_reason="", progress=SimpleNamespace(say=said.append)
    )
    stub.stop = lambda reason: setattr(stub, "stop_reason", reason)
    EarlyStop(5.0).on_validation(stub, {"val/loss": 5.1})
    assert stub.stop_reason == ""
    EarlyStop(0.0).on_validation(stub, {"val/loss": 0.1})
    assert stub.stop_reason == "", "0 disables"
    EarlyStop(5.0).on_validation(stub, {"val/loss": 4.9})
    assert stub.stop_reason == "train.stop_at_val_loss" and "stopping" in said[0]
    assert Trainer.stop.__doc__  # the trainer offers the same stop() the stub stands in for


# -- the trainer: one real run, events recorded -------------------------------------------------------------

RUN = [
    *tiny_model(hidden_size=64, num_kv_heads=2, max_seq_len=32, vocab_size=None),
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=2000",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=6",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.val_every=2",
    "train.val_sequences=8",
    "checkpoint.every_steps=2",
    "cluster.use_ray=false",
    "stability.plot_at_end=false",
]


def test_a_real_run_emits_events_in_order_and_early_stop_and_profiling_are_callbacks(workdir):
    """The real trainer of a 1-worker run with a recording callback added: the documented event order (step hooks
    inside the step, validation and checkpoint inside the step's end, run end last), EarlyStop ending the run at
    its first good validation, ProfilerCallback writing a trace of its steps, RunSummary writing the summary."""
    import gc
    import json

    from mlflow import MlflowClient

    from pretrain import startup_gc
    from pretrain.driver.prepare import prepare_new
    from pretrain.train.callbacks.base import Callback
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

    job = prepare_new(
        load_config(DEMO, RUN + ["train.stop_at_val_loss=100", "train.profile_at=1", "train.profile_steps=2"])
    )
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
        "step_start 1",
        *step,
        "step_end 1",
        "step_start 2",
        *step,
        "validation 2",
        "checkpoint step_00000002",
        "step_end 2",
        "run_end",
    ], "EarlyStop (val loss <= 100) ends the run after the first validation"
    assert final["step"] == 2 and final["run_id"] == job.run_id and trainer.stop_reason == "train.stop_at_val_loss"
    import deepspeed.comm.comm as ds_comm

    assert ds_comm.cdb.shm_comm_op is None, "a world of one builds no shared-memory all-reduce op"
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


def test_bad_records_of_the_validation_sources_are_reported_in_one_line(workdir, capsys):
    """data.val_sources are read by validation only: their bad records (skipped) are reported when the run starts."""
    import json

    from pretrain.driver.prepare import prepare_new
    from pretrain.train.worker import build_trainer

    val = workdir / "val.jsonl"
    lines = [json.dumps({"text": f"held out document {i} with a few words in it"}) for i in range(200)]
    lines[2] = "{broken"
    val.write_text("\n".join(lines) + "\n")
    job = prepare_new(load_config(DEMO, [*RUN, f"data.val_sources=[{{path: {val}}}]"]))
    capsys.readouterr()
    build_trainer(asdict(job), [])
    out = capsys.readouterr().out
    assert (
        f"validation: data.val_sources: 1 bad record(s) skipped (1 invalid_json); first: {val}:3: invalid JSON" in out
    )
