"""``train.compile=yes`` in a real 2-worker training job (ZeRO-2, layer dropout): the losses of the eager run, and
resume exact."""

from __future__ import annotations

import dataclasses

import pytest

from pretrain.config import load_config
from tests.harness import metric_history, run_jobs, tiny_model


def test_compiled_training_job_resumes_exactly(tmp_path, capfd):
    """2 workers under ZeRO-2 with layer dropout, ``train.compile=yes``: the per-step losses stay within 1e-5 of the
    eager run, and a run stopped at step 3 and resumed reproduces the uninterrupted compiled run bitwise."""
    from pathlib import Path

    from pretrain.driver.prepare import prepare_new
    from tests.conftest import ROOT, in_workdir

    opts = [
        *tiny_model(max_seq_len=32, vocab_size=None),
        "data.tokenizer_vocab_size=512",
        "data.tokenizer_train_docs=3000",
        "data.num_streams=2",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.max_steps=6",
        "train.warmup_steps=2",
        "train.log_every=1",
        "train.val_every=0",
        "train.val_sequences=8",
        "checkpoint.every_steps=3",
        "cluster.num_workers=2",
        "cluster.use_ray=false",
        "stability.plot_at_end=false",
        "zero.stage=2",
        "layer_drop.rate=0.3",
        "layer_drop.granularity=sublayer",
        "layer_drop.schedule=progressive",
    ]
    cfg_path = ROOT / "configs" / "demo-decoder.yaml"
    with in_workdir(tmp_path):
        eager = prepare_new(load_config(cfg_path, opts + ["train.compile=no"]))
        tok = [f"data.tokenizer={Path(eager.run_dir) / 'tokenizer'}"]
        full = prepare_new(load_config(cfg_path, opts + tok + ["train.compile=yes"]))
        part = prepare_new(load_config(cfg_path, opts + tok + ["train.compile=yes", "faults.stop_after_step=3"]))
        run_jobs(2, [eager, full, part])
        resumed = dataclasses.replace(part, config={**part.config})
        resumed.config["faults"] = {**resumed.config["faults"], "stop_after_step": -1}
        run_jobs(2, [resumed])
        ref, got, compiled = (metric_history(j.run_id) for j in (eager, part, full))
    assert sorted(compiled) == list(range(1, 7))
    assert all(got[s] == compiled[s] for s in range(1, 7)), (compiled, got)
    assert [compiled[s] for s in range(1, 7)] == pytest.approx([ref[s] for s in range(1, 7)], rel=1e-5)
    out = capfd.readouterr().out  # rank 0's start line of each of the 4 runs
    assert (out.count("compiled blocks on"), out.count("compiled blocks off")) == (3, 1), out[-3000:]
