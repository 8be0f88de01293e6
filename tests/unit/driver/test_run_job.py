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
    # a run no store knows (tracking.enabled=false): named by its directory, which the commands read
    local = Job(config=to_dict(cfg), run_id="local-0123456789ab", run_dir=str(tmp_path), tracking_uri="")
    assert _resume_command(local, 5) == f"./launch.sh resume {tmp_path}"
    spaced = Job(config=to_dict(cfg), run_id="local-0123456789ab", run_dir="/tmp/my runs/x", tracking_uri="")
    assert _resume_command(spaced, 5) == "./launch.sh resume '/tmp/my runs/x'"  # runs as printed
    assert _stopped_at_once("SIGTERM", job).endswith(
        "the run has no committed checkpoint, so there is nothing to resume"
    )


def test_the_printed_commands_start_as_the_user_starts_commands(tmp_path, monkeypatch):
    """The launcher's path relative to the working directory; without it, the console command that ran this one
    (:mod:`pretrain.invocation`)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    job = Job(config=to_dict(load_config(None, [])), run_id="abc", run_dir=str(tmp_path), tracking_uri="")
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv("PRETRAIN_LAUNCHER", str(tmp_path / "launch.sh"))
    assert _resume_command(job, 1) == f"./{tmp_path.name}/launch.sh resume abc"
    monkeypatch.delenv("PRETRAIN_LAUNCHER")
    monkeypatch.setattr("sys.argv", [str(tmp_path / "bin" / "pretrain"), "train"])
    assert _resume_command(job, 1) == "pretrain resume abc"
    monkeypatch.setattr("sys.argv", ["-m", "train"])
    assert _resume_command(job, 1) == "python -m pretrain resume abc"


def test_a_tracking_servers_password_is_never_printed(tmp_path, monkeypatch, capsys):
    """A password in ``MLFLOW_TRACKING_URI`` stays out of the summary (whose commands then rely on the shell that has
    it set), of the UI line (a server serves its own UI: the run's link; a database store's line names no URI), and
    of any error line."""
    from pretrain.cli import without_passwords
    from pretrain.driver.run_job import print_summary
    from pretrain.train.tracking import shown_uri

    secret = "http://user:S3cretPW@127.0.0.1:5126"
    assert shown_uri(secret) == "http://user:***@127.0.0.1:5126" and shown_uri("sqlite:////x.db") == "sqlite:////x.db"
    assert shown_uri("https://T0ken@mlflow.example/p?q=1") == "https://***@mlflow.example/p"
    assert without_passwords(f"cannot reach {secret}/api/2.0") == "cannot reach http://user:***@127.0.0.1:5126/api/2.0"
    # the userinfo ends at the authority's last @ (as urlsplit and HTTP clients read it): an @ in the user name or in
    # the password leaks nothing
    for url, shown in (
        ("https://me@corp.com:S3cret@host/d.jsonl", "https://me@corp.com:***@host/d.jsonl"),
        ("https://user:Tr0ub@dor@host/d.jsonl", "https://user:***@host/d.jsonl"),
        ("s3://AKIA:k3y@bucket/x and ftp://anon@host/y", "s3://AKIA:***@bucket/x and ftp://***@host/y"),
        ("https://ghp_T0ken@github.com/o/r.git", "https://***@github.com/o/r.git"),
        ("https://h/d.jsonl?X-Amz-Signature=S1g&a=1&token=T0k", "https://h/d.jsonl?X-Amz-Signature=***&a=1&token=***"),
        ("https://h/x?sig=S1g#f and ?api_key=K3y", "https://h/x?sig=***#f and ?api_key=***"),
        ('{"path": "https://h/d?token=T0k", "n": 1}', '{"path": "https://h/d?token=***", "n": 1}'),  # JSON stays JSON
        ("http://host:8080/a?b=c@d see bob@example.com", "http://host:8080/a?b=c@d see bob@example.com"),
        ("postgresql://mlflow:pa#ss@db/mlflow", "postgresql://mlflow:***@db/mlflow"),
        ("mysql://u:p?w@h/db", "mysql://u:***@h/db"),
    ):
        assert without_passwords(url) == shown, url
    cfg = load_config(None, ["train.max_steps=8"])
    database = "postgresql://alice:S3cretPW@db.example/mlflow"
    for uri in (secret, database, "https://S3cretPW@mlflow.example", "sqlite:////tmp/m.db"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        job = Job(config=to_dict(cfg), run_id="local-1", run_dir=str(tmp_path), tracking_uri="")
        print_summary({"step": 8, "final_train_loss": 1.0}, job, uri)
        out = capsys.readouterr().out
        assert "S3cretPW" not in out and ("MLflow UI:" in out) != uri.startswith("http")
        assert ("--backend-store-uri sqlite:////tmp/m.db" in out) == uri.startswith("sqlite")
        assert ("resume:      MLFLOW_TRACKING_URI=sqlite:////tmp/m.db ./launch.sh resume" in out) == (uri[0] == "s")


def test_a_stop_while_a_trained_run_ends_leaves_it_finished(tmp_path, monkeypatch, capfd):
    """A Ctrl-C while the command ends Ray after the run has trained waits (one line) for the run's end to be
    recorded: the run is ``FINISHED`` and the summary printed, not a run marked ``KILLED`` that trained to its end."""
    import os
    import signal

    from mlflow import MlflowClient

    import cluster.launch
    import cluster.ray_process
    from pretrain.driver.run_job import run_job
    from pretrain.train.tracking import new_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    cfg = load_config(None, ["train.max_steps=8"])
    job = Job(config=to_dict(cfg), run_id=new_run(uri, cfg), run_dir=str(tmp_path / "run"), tracking_uri=uri)
    monkeypatch.setattr(cluster.launch, "run", lambda job, cluster: {"step": 8, "final_train_loss": 1.0})
    monkeypatch.setattr(
        cluster.ray_process, "end_ray_with_process", lambda started: os.kill(os.getpid(), signal.SIGINT)
    )
    assert run_job(lambda held: (job, False), lambda job: "run") == 0
    out, _ = capfd.readouterr()
    log = (tmp_path / "run" / "logs" / "driver.log").read_text()  # the terminal is quiet: lines go to the run's log
    assert "SIGINT: ending the run, which has trained" in log, log
    assert "== finished:" in out and "[pretrain] SIGINT: ending the run" in out, "on the terminal too"
    assert MlflowClient(uri).get_run(job.run_id).info.status == "FINISHED"
