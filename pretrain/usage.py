"""Each command's ``--help``, taken from the one command table: the usage lines of :mod:`pretrain.cli`'s docstring
(what ``python -m pretrain --help`` prints). Commands that parse their arguments with argparse answer ``--help``
themselves. Help or output whose reader has gone (``| head``) ends quietly with SIGPIPE's status."""

from __future__ import annotations

import os
import signal
import sys

HELP_FLAGS = ("-h", "--help")
_ENTRY_INDENT = "    "  # a command's usage line in the table; its continuation lines are indented further


def asks_help(args: list[str]) -> bool:
    """Whether the arguments of a command ask for its help (``-h`` or ``--help`` anywhere among them)."""
    return any(a in HELP_FLAGS for a in args)


def command_usage(doc: str, cmd: str) -> str:
    """The usage of ``cmd``: its entries in the command table of ``doc`` (a line indented by four spaces that starts
    with the command's name, and the more deeply indented lines under it), the first as ``usage: launch.sh ...``,
    the others as ``or: launch.sh ...``, aligned as in the table."""
    entries: list[list[str]] = []
    inside = False
    for line in doc.splitlines():
        if line.startswith(_ENTRY_INDENT) and not line.startswith(_ENTRY_INDENT + " "):  # a command's first line
            inside = line.split()[0] == cmd
            if inside:
                entries.append([line[len(_ENTRY_INDENT) :]])
        elif inside and line.startswith(_ENTRY_INDENT + " "):
            entries[-1].append(line)
        else:
            inside = False
    if not entries:
        raise ValueError(f"no usage line for {cmd!r} in the command table")  # internal: every command has one
    out = []
    for i, (first, *rest) in enumerate(entries):
        head = "usage: launch.sh " if i == 0 else "   or: launch.sh "
        pad = " " * (len(head) - len(_ENTRY_INDENT))
        out += [head + first, *(pad + line for line in rest)]
    out.append("\n(./launch.sh CMD is python -m pretrain CMD, after setup; every command: ./launch.sh --help)")
    return "\n".join(out)


def print_help(text: str) -> int:
    """Print a help text (exit status 0); a reader that stops reading (``--help | head -2``) ends it quietly with
    SIGPIPE's status, as a command's output does in :func:`pretrain.cli.main`."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        if not stdout_closed():
            raise
        return reader_gone()
    return 0


def reader_gone() -> int:
    """The exit status of a command whose stdout's reader has gone (SIGPIPE's); stdout then writes to /dev/null, so
    the interpreter's final flush does not fail again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (any other broken pipe is an error like any other)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (captured output)
        return False
