"""Reading YAML config text safely: duplicate keys refused with both lines, a plain ``+N`` kept as text, and values
whose aliases expand beyond ``MAX_YAML_VALUES`` (an alias bomb) refused before they are built; errors are
:class:`ConfigError` lines. Used by ``loading.py`` for config files and override values, and for checkpoints'
configs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from pretrain.config.errors import ConfigError, clip

PLUS_INT = re.compile(r"^\+[0-9]+$")  # kept as text by the loader (a growth increment); int keys convert it back
SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
"""YAML 1.1's base-60 numbers (``1:00`` is 60): kept as text, so a typed field refuses them instead of a typo
becoming a number."""
OCTAL = re.compile(r"^[-+]?0[0-7_]+$")
"""YAML 1.1's octal numbers (``0144`` is 100, ``010`` is 8): kept as text, as ``08`` is (no octal number), so a
typed field refuses a leading zero instead of reading another number."""


class _Loader(yaml.SafeLoader):
    """The safe loader, refusing duplicate keys (PyYAML keeps the last one silently). A plain scalar ``+N``
    stays the text ``'+N'`` (YAML 1.1 would read the int N, so ``depth: +4`` in a growth schedule would silently
    mean a total of 4 blocks, not 4 more); int keys convert it back to N. A base-60 number (``1:00``) and an octal
    one (``0144``) stay text."""


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.yaml_implicit_resolvers["+"] = [("tag:yaml.org,2002:str", PLUS_INT), *_Loader.yaml_implicit_resolvers["+"]]
for _first in "-+0123456789":
    _Loader.yaml_implicit_resolvers[_first] = [
        ("tag:yaml.org,2002:str", SEXAGESIMAL),
        ("tag:yaml.org,2002:str", OCTAL),
        *_Loader.yaml_implicit_resolvers.get(_first, []),
    ]

MAX_YAML_VALUES = 100_000
"""The most values (scalars, lists, mappings, keys) one YAML config file or override value may stand for, each
``*alias`` counted as a copy of its ``&anchor``: a config has a few hundred, an alias bomb ("billion laughs", ten
nested lists of nine aliases in 350 bytes) a billion."""


def _check_size(node: yaml.Node, sizes: dict[int, int] | None = None, open_: set[int] | None = None) -> int:
    """How many values the composed ``node`` stands for once its aliases are expanded; :class:`ConfigError` above
    ``MAX_YAML_VALUES`` or for an alias inside the value it names (a recursive structure). An alias is the very
    node of its anchor, so memoising by node counts the expansion in time linear in the document, before any
    Python object is built."""
    sizes = {} if sizes is None else sizes
    open_ = set() if open_ is None else open_
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        raise ConfigError("a YAML alias (*name) refers to a value that contains it (a recursive structure)")
    open_.add(id(node))
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    size = 1
    for child in children:
        size += _check_size(child, sizes, open_)
        if size > MAX_YAML_VALUES:
            raise ConfigError(
                f"its YAML aliases (*name) expand it beyond {MAX_YAML_VALUES:,} values (an alias bomb?); a config "
                f"has a few hundred"
            )
    open_.discard(id(node))
    sizes[id(node)] = size
    return size


def load_value(text: str) -> Any:
    """One YAML document as plain data (None when it has none), refused by :func:`_check_size` before it is built."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node)
        _check_duplicates(node, "", set())  # as in a file: {num_layers: 2, num_layers: 8} is refused
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_duplicates(node: yaml.Node, path: str, seen: set[int]) -> None:
    """Refuse a mapping that repeats a key, naming its full key path and both lines."""
    if id(node) in seen:  # an alias: already checked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                where = f"{path}.{key_node.value}" if path else str(key_node.value)
                line = key_node.start_mark.line + 1
                ident = (key_node.tag, key_node.value)
                if ident in first:
                    raise ConfigError(f"{clip(where)}: duplicate key (lines {first[ident]} and {line})")
                first[ident] = line
                _check_duplicates(value_node, where, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicates(item, f"{path}[{i}]", seen)


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None)
    if problem and mark is not None:
        return f"{clip(problem)} (line {mark.line + 1}, column {mark.column + 1})"
    return clip(" ".join(str(e).split()))


def read_yaml(path: str | Path) -> Any:
    """A YAML file as plain data; None for an empty one (no document, or only comments). Invalid YAML,
    undecodable bytes, duplicate keys and aliases that expand it beyond ``MAX_YAML_VALUES`` values raise
    :class:`ConfigError` naming the file."""
    where = clip(path)
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the config file ({e.strerror or e})") from None
    loader = None
    try:
        loader = _Loader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node)  # before anything walks the aliases' expansion
        _check_duplicates(node, "", set())
        return loader.construct_document(node)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: invalid YAML: {_yaml_problem(e)}") from None
    except (ValueError, TypeError) as e:  # PyYAML's constructors: e.g. a date 2001-13-45
        raise ConfigError(f"{where}: invalid YAML value: {clip(e)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: invalid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
