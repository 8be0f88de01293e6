"""The prefix of printed commands (:mod:`pretrain.invocation`): the checkout's launcher from the checkout, its path
from elsewhere, a prefix handed on as it is, the console command, ``python -m pretrain``; and the commands that
``run_job`` prints with it."""

from __future__ import annotations

import sys

import pytest

from pretrain.invocation import LAUNCHER_ENV, command


@pytest.fixture
def launcher(monkeypatch):
    """Set (or, with None, unset) ``PRETRAIN_LAUNCHER`` for one test."""

    def set_to(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(LAUNCHER_ENV, raising=False)
        else:
            monkeypatch.setenv(LAUNCHER_ENV, value)

    return set_to


def test_the_launcher_relative_to_the_working_directory(launcher, tmp_path):
    checkout = tmp_path / "my project"
    (checkout / "sub").mkdir(parents=True)
    launcher(str(checkout / "launch.sh"))
    assert command(str(checkout)) == "./launch.sh"
    assert command(str(tmp_path)) == "'./my project/launch.sh'"  # quoted: pasted into a shell as it is
    assert command(str(checkout / "sub")) == f"'{checkout}/launch.sh'"  # outside: the absolute path
    assert command(str(tmp_path.parent / "elsewhere")) == f"'{checkout}/launch.sh'"


def test_a_prefix_handed_on_is_printed_as_it_is(launcher, tmp_path):
    for given in ("./launch.sh", "python -m pretrain", "pretrain"):
        launcher(given)
        assert command(str(tmp_path)) == given


def test_without_the_launcher_the_command_that_started_this_one(launcher, monkeypatch):
    launcher(None)
    monkeypatch.setattr(sys, "argv", ["/opt/venv/bin/pretrain", "train"])
    assert command() == "pretrain"
    monkeypatch.setattr(sys, "argv", ["/src/pretrain/__main__.py", "train"])  # python -m pretrain, torchrun -m
    assert command() == "python -m pretrain"
    launcher("  ")  # set but empty: as unset
    assert command() == "python -m pretrain"
