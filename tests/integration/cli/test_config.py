"""Config errors through the command line: exit 2 with one line, no traceback."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, cli_env
from tests.harness import cli


@pytest.mark.parametrize(
    "args",
    [
        ["model.num_layerz=3"],
        ["configs/nope.yaml"],
        ["train.max_steps=ten"],
        ["moe.num_experts=4", "moe.balance=bias", "moe.bias_rate=0"],
    ],
)
def test_cli_config_errors_exit_2_with_one_line(tmp_path, args):
    proc = cli(ROOT, "train", *args, expect=2, timeout=120, env=cli_env(tmp_path))
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
