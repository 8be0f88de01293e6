"""What a run tells its user, through the command line: a bad new field (a source name) is one line, exit 2,
before Ray."""

from __future__ import annotations

from tests.unit.train.test_mlflow_records import DEMO


def test_bad_new_field_is_one_line_exit_2_before_ray(tmp_path):
    import subprocess
    import sys

    from tests.conftest import cli_env

    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "train", str(DEMO), "data.sources=[{path: demo, name: 'a/b'}]"],
        cwd=tmp_path,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "data.sources[0].name" in proc.stderr
    assert "ray" not in proc.stdout.lower()
