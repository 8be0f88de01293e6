"""The project as an installed package, run as commands: the venv's ``pretrain`` console command is
``python -m pretrain``, and ``./launch.sh setup`` refuses an unknown torch build in one line (no build, no
install)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import tomllib
from pathlib import Path

from tests.conftest import PYTHON, ROOT, cli_env
from tests.harness import cli

# -- the package ----------------------------------------------------------------------------------------------


def test_console_script_is_python_m_pretrain(tmp_path):
    """``./launch.sh setup`` installed the project: the venv has a ``pretrain`` command, declared in pyproject.toml
    and installed from it, and ``pretrain --help`` prints what ``python -m pretrain --help`` prints."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"pretrain": "pretrain.__main__:main"}
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="pretrain")
    assert entry.value == "pretrain.__main__:main", "the venv's install is stale: ./launch.sh setup"
    script = Path(PYTHON).parent / "pretrain"
    assert script.is_file(), f"{script} is missing: ./launch.sh setup installs the project"
    env = cli_env(tmp_path)
    command = subprocess.run([str(script), "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    module = cli(tmp_path, "--help", expect=0, timeout=60, env=env)
    assert command.returncode == 0, command.stderr
    assert command.stdout == module.stdout and "train [CONFIG.yaml]" in command.stdout
    unknown = subprocess.run(
        [str(script), "nosuchcommand"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: unknown command 'nosuchcommand'")


def test_setup_picks_the_lock_and_refuses_an_unknown_choice():
    """``PRETRAIN_TORCH`` other than cuda|cpu|system: one line, exit 2, before the venv is touched; the stamp of this
    venv names the lock it was made from (and the environment's torch it was set up around, if any)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "launch.sh"), "setup"],
        env={"PATH": "/usr/bin:/bin", "PRETRAIN_TORCH": "rocm", "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == "[setup] error: PRETRAIN_TORCH must be cuda, cpu or system, got 'rocm'"
    ), proc.stderr
    stamp = Path(PYTHON).parent.parent / ".pretrain-setup"
    if stamp.is_file():  # a venv made by ./launch.sh setup (not, e.g., a CI image's)
        first = stamp.read_text().splitlines()[0]
        assert re.fullmatch(
            r"requirements(-cuda)?\.lock sha256=[0-9a-f]{64} python \d+\.\d+( around the environment's torch .*)?",
            first,
        )
    text = (ROOT / "launch.sh").read_text()
    assert "/proc/driver/nvidia/version" in text and "nvidia-smi" in text
