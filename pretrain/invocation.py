"""How the user starts this project's commands, for the commands a command prints (the next step after a run, the
fix in an error): ``./launch.sh resume RUN`` where the user runs the checkout's launcher from the checkout, the
launcher's path from anywhere else, ``pretrain resume RUN`` after the console command, ``python -m pretrain resume
RUN`` otherwise (``torchrun ... -m pretrain`` included). Standard library only: every layer prints commands.

``PRETRAIN_LAUNCHER`` says it. ``launch.sh`` exports its own absolute path; an absolute path is printed relative to
the working directory when the launcher lies under it, else as it is. Any other value is printed as it is: ``submit``
hands the submitter's own prefix to the job, whose printed commands the user reads (``logs JOB``) in the shell
that submitted it.

Commands only ``launch.sh`` has (``setup``, ``wheelhouse``, ``lock``, ``lint``, ``test``) are printed with it
whatever the prefix: ``python -m pretrain`` has no such commands."""

from __future__ import annotations

import os
import shlex
import sys

LAUNCHER_ENV = "PRETRAIN_LAUNCHER"
"""The variable that holds the prefix (``launch.sh`` sets it to its path; ``submit`` passes it to the job)."""

CONSOLE_SCRIPT = "pretrain"
"""The console command that ``pyproject.toml`` installs (``[project.scripts]``)."""


def command(cwd: str | None = None) -> str:
    """The prefix of a printed command, ready to paste into a shell in ``cwd`` (default: the working directory)."""
    given = os.environ.get(LAUNCHER_ENV, "").strip()
    if given:
        if not os.path.isabs(given):
            return given
        here = os.path.abspath(cwd or os.getcwd())
        rel = os.path.relpath(given, here)
        inside = rel != os.pardir and not rel.startswith(os.pardir + os.sep)
        return shlex.quote("./" + rel if inside else given)
    if os.path.basename(sys.argv[0] if sys.argv else "") == CONSOLE_SCRIPT:
        return CONSOLE_SCRIPT
    return "python -m pretrain"
