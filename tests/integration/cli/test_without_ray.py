"""Ray only where Ray is used: with Ray not importable, ``torchrun`` trains one run on two ranks with the losses of
the 2-worker Ray reference run, a one-process resume continues it bitwise, and the commands that neither start nor
reach Ray (export, eval, verify, runs, grow) work; a job or command that needs Ray is refused in one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

from mlflow import MlflowClient

from tests.harness import CONFIG, E2E, PYTHON, ROOT, cli, cli_env, metric_history, run_id_of


def without_ray(work: Path) -> dict[str, str]:
    """The command environment of ``work`` in which ``import ray`` fails as if Ray were not installed (and
    ``importlib.util.find_spec("ray")`` finds nothing), in every process started from it."""
    blocker = work / "no-ray"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\n\nsys.modules['ray'] = None\n")
    return {**cli_env(work), "PYTHONPATH": f"{blocker}:{ROOT}"}


def test_without_ray_torchrun_trains_one_run_and_local_commands_work(tmp_path, reference):
    env = without_ray(tmp_path)
    assert subprocess.run([PYTHON, "-c", "import ray"], env=env, capture_output=True).returncode == 1

    refused = cli(tmp_path, "train", CONFIG, *E2E, expect=2, env=env)  # 2 workers through Ray Train
    line = refused.stderr.strip()
    assert "\n" not in line and "cluster.use_ray" in line and "not installed" in line, line
    assert "cluster.use_ray=false" in line, line
    assert not (tmp_path / "checkpoints").exists()
    for command in (["submit", CONFIG], ["jobs"], ["cluster", "up"]):
        line = cli(tmp_path, *command, expect=2, env=env).stderr.strip()
        assert "\n" not in line and f"./launch.sh {command[0]} runs on Ray" in line, line

    # torchrun: one run, rank 0 tracks it, both ranks write its checkpoints, the Ray run's losses
    proc = cli(
        tmp_path, "train", CONFIG, *E2E, "cluster.use_ray=false", "train.max_steps=4", env=env, ranks=2, timeout=600
    )
    run_id = run_id_of(proc.stdout)
    uri = env["MLFLOW_TRACKING_URI"]
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [run_id]
    run_dir = tmp_path / "checkpoints" / run_id
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [run_id]
    assert (run_dir / "logs" / "rank_1.log").is_file()
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_00000002", "step_00000004"]
    want = reference["losses"]
    assert metric_history(run_id, uri=uri) == {s: want[s] for s in (1, 2, 3, 4)}

    # one process, still no Ray: resume to the reference's end (2 -> 1 workers), then the local commands
    cli(tmp_path, "resume", run_id, "train.max_steps=8", "cluster.num_workers=1", env=env)
    assert metric_history(run_id, uri=uri) == want
    cli(tmp_path, "verify", run_id, env=env)
    cli(tmp_path, "export", run_id, "--out", str(tmp_path / "hf"), env=env)
    assert (tmp_path / "hf" / "config.json").is_file()
    assert '"loss"' in cli(tmp_path, "eval", run_id, "--json", env=env).stdout
    child = run_id_of_child(cli(tmp_path, "grow", run_id, "depth=2x", env=env).stdout)
    assert child in cli(tmp_path, "runs", env=env).stdout


def run_id_of_child(stdout: str) -> str:
    """The child run a ``grow`` printed (its ``resume:`` line)."""
    return next(line.split()[3] for line in stdout.splitlines() if line.strip().startswith("resume:"))
