"""The commands a stopped run prints (``pretrain/driver/run_job.py``): a stop before the last step resumes with
``resume RUN_ID`` alone; a stop at the last step (or a stop at once whose latest checkpoint is the last) with the
overrides that train on, since a bare resume there has nothing to train and is refused. The stops themselves, through
the CLI, are in ``tests/integration/train/test_stop.py``."""

from __future__ import annotations

from pretrain.config import load_config, to_dict
from pretrain.driver.run_job import _resume_command, _stopped_at_once
from pretrain.train.job import Job
from pretrain.train.schedule import train_longer


def test_a_stop_at_the_last_step_prints_a_resume_that_trains(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, ["train.max_steps=8", "train.warmup_steps=2"])
    job = Job(config=to_dict(cfg), run_id="abc", run_dir=str(tmp_path), tracking_uri="")
    assert _resume_command(job, 5) == "./launch.sh resume abc"
    assert _resume_command(job, 8) == f"./launch.sh resume abc {train_longer(cfg.train, 8)}"
    assert "train.max_steps=16" in _resume_command(job, 8)
    assert _stopped_at_once("SIGTERM", job).endswith(
        "the run has no committed checkpoint, so there is nothing to resume"
    )
