"""What a run tells its user, through the command line: a bad new field (a source name) is one line, exit 2,
before Ray."""

from __future__ import annotations

from tests.harness import cli
from tests.unit.train.test_mlflow_records import DEMO


def test_bad_new_field_is_one_line_exit_2_before_ray(tmp_path):
    proc = cli(tmp_path, "train", str(DEMO), "data.sources=[{path: demo, name: 'a/b'}]", expect=2, timeout=120)
    assert proc.stderr.strip().count("\n") == 0 and "data.sources[0].name" in proc.stderr
    assert "ray" not in proc.stdout.lower()
