"""The config error type (its own module so every part of the config tree can raise it) and the helpers that keep
a user error one short line: :func:`quote` and :func:`clip` bound what a message shows of a value, a key, a path
or another error's text; :func:`not_a` says what a path that is not a regular file (or directory) is instead;
:func:`without_passwords` keeps a URL's secrets out of any printed line."""

from __future__ import annotations

import argparse
import os
import re
import reprlib
import stat
from pathlib import Path
from typing import NoReturn

_URL_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)([^\s/]*)@", re.IGNORECASE)
"""A URL's scheme and its userinfo: what comes before the last ``@`` ahead of the first ``/``, as ``urlsplit`` and
HTTP clients split it (a user name may hold an ``@``, ``me@corp.com:PASSWORD@host``, and so may a password, with a
``#`` or ``?`` too, which database URLs take unencoded)."""
_SECRET_QUERY = re.compile(
    r"([?&](?:key|sig|[\w.-]*(?:token|signature|secret|password|passwd|credential|api[_-]?key|access[_-]?key)"
    r"[\w.-]*)=)[^&\s#\"',;)}\]]+",
    re.IGNORECASE,
)
"""A query parameter that carries a secret (``?token=``, ``&sig=``, ``X-Amz-Signature=``, ``api_key=``, ``key=``):
the name and its ``=``, then the value."""

LIMIT = 200
"""The most characters of one value (a config value, a key, a path, a record's field) an error message shows."""
MESSAGE_LIMIT = 2000
"""The most characters of a whole :class:`ConfigError` message (a last bound: each value is quoted within
``LIMIT``)."""

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def clip(text: object, limit: int = LIMIT) -> str:
    """``str(text)`` when it has at most ``limit`` characters, else its first ``limit`` followed by
    ``... (N chars)``, N the length of the whole text."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} chars)"


def quote(value: object, limit: int = LIMIT) -> str:
    """``repr(value)`` in at most ``limit`` characters (plus a short suffix). A longer string or bytes value shows
    its first ``limit`` characters and ``... (N chars)``, N its length; it is cut before it is repr'd, so a 50 MB
    value is never copied whole. Any other value is repr'd through :mod:`reprlib` (a few items per container, a
    few levels deep), so a huge list, or one whose items are aliases of one list, is never expanded."""
    if isinstance(value, (str, bytes, bytearray)):
        if len(value) <= limit:
            return clip(repr(value), limit)  # escapes (\x00) may make the repr longer than the value
        return f"{repr(value[:limit])[:limit]}... ({len(value):,} chars)"
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxlong, short.maxother = 3, limit, limit, limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = short.maxfrozenset = 10
    try:
        text = short.repr(value)
    except ValueError:  # an int beyond Python's 4,300-digit limit of str conversion
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit]}..."


def not_a(path: str | Path, wanted: str = "a regular file") -> str:
    """``"is a FIFO, not a regular file"`` when ``path`` exists but is not ``wanted`` (``"a regular file"`` or
    ``"a directory"``; a symbolic link counts as what it points to), for a message ``f"{path} {not_a(path)}"``;
    '' when it is ``wanted`` or does not exist (or is a broken link). Only ``stat``: a FIFO is never opened, so
    this never blocks."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, a broken link, a name too long, a NUL byte
        return ""
    what = next((kind for test, kind in _KINDS if test(mode)), "an unknown kind of file")
    return "" if what == wanted else f"is {what}, not {wanted}"


class ConfigError(ValueError):
    """A user error in a config: the message names the full key path. It is one line (line breaks, say of a value
    the user typed, become spaces) of at most ``MESSAGE_LIMIT`` characters."""

    def __init__(self, message: object = "") -> None:
        super().__init__(clip(" ".join(str(message).splitlines()), MESSAGE_LIMIT))


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser for a command whose bad arguments are a :class:`ConfigError` (one line, exit 2 through
    the CLI's handling) instead of argparse's usage text and exit."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")


def without_passwords(text: str) -> str:
    """``text`` with the secrets of any URL in it replaced by ``***``: the password of ``scheme://user:password@host``
    (the user name is what comes before the userinfo's first ``:``, the password all after it), a userinfo with no
    password whole (``https://TOKEN@host``, as git and HTTP clients take a token), and the value of a query parameter
    named for a secret (:data:`_SECRET_QUERY`)."""

    def masked(m: re.Match[str]) -> str:
        user, colon, _ = m[2].partition(":")
        return f"{m[1]}{user}:***@" if colon else f"{m[1]}***@"

    return _SECRET_QUERY.sub(r"\1***", _URL_USERINFO.sub(masked, text))


# Errors a user acts on, by class name (a worker's error may reach us only as text): the config, data or a
# checkpoint is wrong (exit 2), or the run ended by a rule the user set (exit 1); either is one line, no traceback.
EXIT_CODES = {
    "NonFiniteWeightsError": 1,
    "StabilityHaltError": 1,
    "ExportError": 1,
    "GrowthCheckError": 1,
    "ConfigError": 2,
    "BadRecordError": 2,
    "BadCheckpoint": 2,
    "CheckpointNotWritable": 2,
    "CheckpointError": 2,
}
_OURS = ("pretrain.", "cluster.", "eval.", "benchmarks.")
"""The packages whose classes :data:`EXIT_CODES` names (another library's ``CheckpointError``, e.g.
``torch.utils.checkpoint``'s, is an internal error)."""
_AS_TEXT = re.compile(r"\b(?:pretrain|cluster|eval|benchmarks)(?:\.\w+)+\.(\w+): (.*)")
"""The last line of a traceback of one of our errors: ``pretrain.config.errors.ConfigError: message``."""


def known_error(exc: BaseException) -> tuple[str, str] | None:
    """(class name, first line) of the most specific class of :data:`EXIT_CODES` that ``exc`` is, or an error it
    wraps is: raised here, or in a Ray worker, whose failure reaches us wrapped in Ray's errors (as objects, or only
    as the text of its traceback). None for any other error."""
    seen = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        for cls in type(e).__mro__:  # the most specific known class decides
            if cls.__name__ in EXIT_CODES and cls.__module__.startswith(_OURS):
                return cls.__name__, (str(e).strip().splitlines() or [cls.__name__])[0]
        for attr in ("worker_failures", "_worker_failures"):
            failures = getattr(e, attr, None)
            if isinstance(failures, dict):
                stack.extend(v for v in failures.values() if isinstance(v, BaseException))
        wrapped = (e.__cause__, e.__context__, getattr(e, "cause", None), getattr(e, "_base_exc", None))
        stack.extend(x for x in wrapped if isinstance(x, BaseException))  # _base_exc: Ray Train's worker errors
    for line in str(exc).strip().splitlines():
        m = _AS_TEXT.search(line)
        if m and m.group(1) in EXIT_CODES:
            return m.group(1), m.group(2)
    return None


def user_error(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, one line) of an error the user acts on (:func:`known_error`, :data:`EXIT_CODES`); None for an
    internal error."""
    known = known_error(exc)
    return (EXIT_CODES[known[0]], known[1]) if known is not None else None
