"""``./launch.sh setup``'s own decisions, run as commands on a copy of the launcher, its locks and its Python half,
with a stand-in for uv that logs what it is asked and does nothing (what uv then installs is
``tests/integration/house/test_install.py``'s): when the venv counts as set up, what several commands started
together do, and what setup refuses before it changes anything."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

FILES = [
    "launch.sh",
    "pyproject.toml",
    "requirements.txt",
    "requirements-torch.txt",
    "requirements.lock",
    "requirements-cuda.lock",
    "cluster/__init__.py",
    "cluster/install.py",
    "cluster/environment.py",
    "cluster/lockfile.py",
    "cluster/wheelhouse.py",
]
UV_VERSION = re.search(r'^UV_VERSION="([^"]+)"', (ROOT / "launch.sh").read_text(), re.M).group(1)
FAKE_UV = """#!/bin/sh
echo "$*" >>"$UV_LOG"
case "$1 $2" in "pip sync") exit "${UV_SYNC_RC:-0}" ;; esac
if [ "$1" = venv ]; then  # uv venv ... DIR: the venv, its python the fixture's (uv clears only a venv)
  for last in "$@"; do :; done
  if [ -d "$last" ] && [ ! -f "$last/pyvenv.cfg" ]; then
    echo "error: uv will not clear a directory that is not a virtual environment" >&2; exit 2
  fi
  rm -rf "$last" && mkdir -p "$last/bin" && touch "$last/pyvenv.cfg" && cp "$FAKE_PYTHON" "$last/bin/python"
fi
exit 0
"""


@pytest.fixture
def checkout(tmp_path) -> Path:
    """The launcher's files (no venv yet, as in a fresh clone), the stand-in uv where setup keeps the one it fetched,
    and the python its ``uv venv`` gives the venv: this one, less DeepSpeed's background build (which setup starts
    after a CPU install)."""
    dest = tmp_path / "co"
    for rel in FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    python = tmp_path / "python"  # what the stand-in uv's `uv venv` puts in the venv
    python.write_text(f'#!/bin/sh\ncase "$2" in *deepspeed*) exit 0 ;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    uv = tmp_path / "xdg" / "pretrain" / f"uv-{UV_VERSION}" / "uv"
    uv.parent.mkdir(parents=True)
    uv.write_text(FAKE_UV)
    uv.chmod(0o755)
    return dest


def _env(checkout: Path, **changes: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("PRETRAIN_", "PYTHON", "UV_", "CDPATH"))}
    xdg, python = checkout.parent / "xdg", checkout.parent / "python"
    return {
        **keep,
        "XDG_CACHE_HOME": str(xdg),
        "UV_LOG": str(checkout.parent / "uv.log"),
        "FAKE_PYTHON": str(python),
        **changes,
    }


def _setup(checkout: Path, *args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(checkout / "launch.sh"), "setup", *args],
        cwd=cwd or checkout,
        env=_env(checkout, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _uv_calls(checkout: Path) -> list[str]:
    log = checkout.parent / "uv.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def test_an_interrupted_setup_leaves_no_stamp_a_later_one_trusts(checkout):
    """A setup for another lock (``PRETRAIN_TORCH=cuda``) stopped while uv changes the venv (Ctrl-C: 130) leaves it
    part one lock, part the other: its stamp says so ("incomplete"), and the next setup, back on the first lock,
    installs again instead of finding the earlier stamp and calling the venv current. A setup that completes is
    current for the next one."""
    first = _setup(checkout, PRETRAIN_TORCH="cpu", PYTHON=sys.executable)  # a fresh clone: no .venv yet
    assert first.returncode == 0, first.stderr
    calls = _uv_calls(checkout)
    assert calls[0].startswith("venv") and any(c.startswith("pip sync") for c in calls)
    stamp = (checkout / ".venv" / ".pretrain-setup").read_text()
    v = sys.version_info
    assert stamp.startswith("requirements.lock sha256=") and f" python {v.major}.{v.minor}\n" in stamp, stamp

    stopped = _setup(checkout, PRETRAIN_TORCH="cuda", UV_SYNC_RC="130")
    assert stopped.returncode == 130 and (checkout / ".venv" / ".pretrain-setup").read_text() == "incomplete\n"
    assert any(c.startswith("pip sync") and "requirements-cuda.lock" in c for c in _uv_calls(checkout))

    again = _setup(checkout)  # the saved choice: the CPU lock
    assert again.returncode == 0, again.stderr
    assert any(c.startswith("pip sync") and re.search(r"/requirements\.lock( |$)", c) for c in _uv_calls(checkout))
    assert _setup(checkout).returncode == 0 and _uv_calls(checkout) == []  # current now


def test_commands_started_together_on_a_current_venv_all_run(checkout):
    """Every command runs setup first; a loop that starts several at once (``./launch.sh eval R &``) must not see
    one of them fail on another's rename of the saved choice. Also from another directory with ``CDPATH`` set
    (``cd`` then prints the directory it found)."""
    assert _setup(checkout, PRETRAIN_TORCH="cpu", PYTHON=sys.executable).returncode == 0
    _uv_calls(checkout)
    for _ in range(2):
        procs = [
            subprocess.Popen(
                ["bash", str(checkout / "launch.sh"), "setup"],
                cwd=checkout,
                env=_env(checkout, PRETRAIN_TORCH="cpu"),  # asked each time: each one writes the choice
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(12)
        ]
        results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
        for p in procs:
            p.stdout.close()  # type: ignore[union-attr]
            p.stderr.close()  # type: ignore[union-attr]
        assert results == [(0, "")] * 12, [r for r in results if r != (0, "")]
    assert not list((checkout / ".venv").glob(".pretrain-choice.tmp*"))
    elsewhere = _setup(checkout, cwd=checkout.parent, CDPATH=".:")
    assert elsewhere.returncode == 0 and elsewhere.stderr == "", elsewhere.stderr
    assert _uv_calls(checkout) == []


def test_setup_refuses_an_old_python_and_an_unpinned_uv_before_changing_anything(checkout, tmp_path):
    """A Python older than 3.11 (``PYTHON=``, any torch kind) is one line, exit 2, before uv runs or the saved choice
    changes. A uv version the lock holds no hashes for (launch.sh's UV_VERSION changed without ``./launch.sh
    lock``) is not fetched unchecked: one line naming the fix."""
    old = tmp_path / "py310"
    (old / "site").mkdir(parents=True)
    (old / "site" / "sitecustomize.py").write_text("import sys\nsys.version_info = (3, 10, 13, 'final', 0)\n")
    (old / "python3").write_text(f'#!/bin/sh\nPYTHONPATH={old / "site"} exec {sys.executable} "$@"\n')
    (old / "python3").chmod(0o755)
    for kind in ("cpu", "cuda", ""):
        proc = _setup(checkout, PYTHON=str(old / "python3"), PRETRAIN_TORCH=kind)
        assert proc.returncode == 2, (kind, proc.stderr)
        assert proc.stderr.splitlines() == [
            f"[setup] error: {old / 'python3'} is Python 3.10; the project needs 3.11 or later "
            "(PYTHON=/path/to/python3.11)"
        ]
    assert _uv_calls(checkout) == [] and not (checkout / ".venv" / ".pretrain-choice").exists()

    launcher = checkout / "launch.sh"
    launcher.write_text(launcher.read_text().replace(f'UV_VERSION="{UV_VERSION}"', 'UV_VERSION="0.0.1"'))
    proc = _setup(checkout, PRETRAIN_TORCH="cpu", PYTHON=sys.executable, PATH=os.defpath)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
        "[setup] error: requirements.lock pins no uv==0.0.1 with its hashes (launch.sh's UV_VERSION): "
        "./launch.sh lock, or put uv 0.0.1 on PATH"
    )
    assert not (tmp_path / "xdg" / "pretrain" / "uv-0.0.1").exists()
