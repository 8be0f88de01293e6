"""The progress line (``pretrain/train/progress.py``): its ETA is the time per step this process ran times the
steps left, also after a rollback to a checkpoint older than the step the run resumed at."""

from __future__ import annotations

from pretrain.train import progress as progress_module
from pretrain.train.progress import Progress

METRICS = {"train/loss": 3.0, "train/lr": 1e-3, "train/grad_norm": 1.0, "train/tokens_per_s": 1000.0}


def test_the_eta_is_the_time_per_step_run_times_the_steps_left(monkeypatch, capsys):
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: now[0])
    p = Progress(max_steps=100, start_step=50, tokens_per_step=100, enabled=True)  # resumed at step 50
    for _ in range(10):
        p.add_step(1.0)
    now[0] = 100.0  # 10 s a step, validation and checkpoints included
    p.line(60, METRICS)
    assert capsys.readouterr().out.rstrip().endswith("ETA 6:40")  # 40 steps left
    p.line(40, METRICS)  # rolled back to step 40's checkpoint, before the resume's step 50
    assert capsys.readouterr().out.rstrip().endswith("ETA 10:00")  # 60 steps left, at the same 10 s a step
