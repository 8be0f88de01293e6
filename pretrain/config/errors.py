"""The config error type (its own module so every part of the config tree can raise it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in a config: the message names the full key path. It is one line: line breaks (say, of a
    value the user typed) become spaces."""

    def __init__(self, message: object = "") -> None:
        super().__init__(" ".join(str(message).splitlines()))
