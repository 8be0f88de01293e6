"""Strict loading of the config tree: YAML (read by ``yaml_reading.py``: duplicate keys and alias bombs refused)
plus dotted overrides; unknown keys, wrong types and non-finite or out-of-range numbers raise :class:`ConfigError`
naming the full key path; an empty config file is refused; messages show at most ``errors.LIMIT`` characters of a
value; round trip through :func:`to_dict` / :func:`from_dict`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from pretrain.config.errors import clip, not_a, quote
from pretrain.config.moved import check_key, migrate
from pretrain.config.runtime import YAML_KEY
from pretrain.config.tree import ConfigError, RunConfig
from pretrain.config.yaml_reading import PLUS_INT, load_value, read_yaml

# The config `train` and `submit` use when none is given (absolute: repository root / configs).
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo-decoder.yaml"

_HINTS: dict[type, dict[str, Any]] = {}
INT_MAX = (1 << 63) - 1  # ints travel through torch, numpy and JSON as int64
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_INDEXED = re.compile(r"^(\w+)\[([^\]]*)\]$")  # an override's list item: sources[0]


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def key_of(f: dataclasses.Field) -> str:
    """The key users write for field ``f``: its name, or its ``YAML_KEY`` metadata (``checkpoint.async`` is the
    field ``async_``, ``async`` being a Python keyword)."""
    return f.metadata.get(YAML_KEY, f.name)


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {quote(value)}"


def _coerce(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type ``tp`` (recursively), returning the typed value."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {_describe(value)}")
        return _build(typing.cast(type, tp), value, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and isinstance(choices[0], str):  # YAML 1.1 reads yes/no/on/off as bools
            value = next(
                (w for w in (("yes", "on", "true") if value else ("no", "off", "false")) if w in choices), value
            )
        if value not in choices or type(value) is not type(choices[0]):
            words = " (YAML reads yes/no, on/off, true/false as a boolean)" if isinstance(value, bool) else ""
            raise ConfigError(f"{path}: expected one of {', '.join(map(str, choices))}; got {quote(value)}{words}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(typing.get_args(tp), value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {_describe(value)}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected bool, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, str) and PLUS_INT.match(value.strip()):  # `+4`, which the loader keeps as text
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {_describe(value)}")
        if abs(value) > INT_MAX:
            raise ConfigError(f"{path}: {quote(value)} is out of range (at most {INT_MAX} in absolute value)")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):  # YAML 1.1 reads 3e-4 as a string
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected float, got {_describe(value)}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{path}: expected a finite float, got {quote(value)}")
        return number
    if tp is str:
        if not isinstance(value, str):
            words = ", quote it (YAML reads yes/no, on/off, true/false as a boolean)" if isinstance(value, bool) else ""
            raise ConfigError(f"{path}: expected str, got {_describe(value)}{words}")
        if "\x00" in value:  # no path, name or field holds one (the OS refuses it in a path)
            raise ConfigError(f"{path}: {quote(value)} holds a NUL character")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (an escape in a quoted YAML string): no file name or text
            raise ConfigError(f"{path}: {quote(value)} is not valid Unicode text (a lone surrogate)") from None
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")  # internal: the tree uses only the above


def _shape(value: Any) -> str:
    """The kind of a plain value, as the branches of a union are told apart: bool, number, str, list or mapping."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (str, list)):
        return type(value).__name__
    return "mapping" if isinstance(value, dict) else type(value).__name__


def _shape_of(tp: Any) -> str:
    """The kind of value type ``tp`` takes (see :func:`_shape`)."""
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if typing.get_origin(tp) is Literal:
        return _shape(typing.get_args(tp)[0])
    if typing.get_origin(tp) is list:
        return "list"
    if tp is bool:
        return "bool"
    return "number" if tp in (int, float) else "str" if tp is str else ""


def _expected(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) is list:
        return f"a list of {getattr(typing.get_args(tp)[0], '__name__', 'values')}"
    return "a mapping" if dataclasses.is_dataclass(tp) else getattr(tp, "__name__", str(tp))


def _coerce_union(args: tuple, value: Any, path: str) -> Any:
    """``value`` as the first branch of a union that takes it; refused with the error of the branch of the value's
    kind (a list checked as the list branch, naming the bad item), or naming every branch when none is of it."""
    if value is None and type(None) in args:
        return None
    branches = [arg for arg in args if arg is not type(None)]
    errors: dict[int, str] = {}
    for i, arg in enumerate(branches):
        try:
            return _coerce(arg, value, path)
        except ConfigError as e:
            errors[i] = str(e)
    same = [i for i, arg in enumerate(branches) if _shape_of(arg) == _shape(value)]
    if same:
        raise ConfigError(errors[same[0]])
    raise ConfigError(f"{path}: expected {' or '.join(map(_expected, branches))}, got {_describe(value)}")


def _build(cls: type, data: dict, path: str) -> Any:
    hints = _hints(cls)
    names = {key_of(f) for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            check_key(path, str(key))
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{clip(where)}: unknown key (valid: {', '.join(sorted(names))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = key_of(f)
        if key in data:
            kwargs[f.name] = _coerce(hints[f.name], data[key], f"{path}.{key}" if path else key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}.{key}: required key is missing" if path else f"{key}: required")
    return cls(**kwargs)


def build_section(cls: type, data: dict, path: str) -> Any:
    """One config dataclass (e.g. a ``GrowthStep``) from a plain dict, strictly; errors name ``path``."""
    return _build(cls, data, path)


def from_dict(data: dict) -> RunConfig:
    """Build and validate a RunConfig from a plain dict (strict)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {_describe(data)}")
    return _build(RunConfig, data, "").validate()


def to_dict(cfg: Any) -> Any:
    """A config dataclass as plain data under the keys users write (:func:`key_of`); :func:`from_dict` reads it."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {key_of(f): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return type(cfg)(to_dict(v) for v in cfg)
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c=value`` in a nested dict, checking each key against its section (an unknown key is refused with
    the valid ones). A mapping given for a section (``model={num_layers: 6}``) is merged into the section's keys so
    far, as a config file is merged (lists in it replace the lists there whole). A list of sections takes an index,
    ``data.sources[0].text_field=value``: the index names an item of the list the config file gives, or of the
    default list when the file gives none; a mapping given for the item (``data.sources[0]={...}``) replaces it."""
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(
            f"{clip(dotted)}: an empty key (or part of one, between dots or at either end); overrides look like "
            "key.sub=value, e.g. train.lr=1e-3"
        )
    cls: Any = RunConfig
    node = tree
    for i, part in enumerate(keys):
        path = clip(".".join(keys[: i + 1]))
        indexed = _INDEXED.match(part)
        key = indexed.group(1) if indexed else part
        if not dataclasses.is_dataclass(cls):
            raise ConfigError(f"{path}: {'.'.join(keys[:i])} is a value, not a section")
        fields = {key_of(f): f for f in dataclasses.fields(cls)}
        if key not in fields:
            check_key(".".join(keys[:i]), key)
            raise ConfigError(f"{path}: unknown key (valid: {', '.join(sorted(fields))})")
        tp = _hints(typing.cast(type, cls))[fields[key].name]
        where = ".".join([*keys[:i], key])  # without the index
        last = i == len(keys) - 1
        if typing.get_origin(tp) is list and not last and not indexed:
            rest = keys[i + 1 :]  # data.sources.0.path: the index written as a key
            example = (
                f"{where}[{rest[0]}]{''.join('.' + k for k in rest[1:])}"
                if rest[0].isdigit()
                else f"{where}[0].{'.'.join(rest)}"
            )
            raise ConfigError(f"{path}: a list; name an item by its index, e.g. {clip(example)}=...")
        if indexed:
            if typing.get_origin(tp) is not list:
                raise ConfigError(f"{path}: {where} is not a list")
            items = node.get(key)
            if items is None:  # not in the file: the default list
                f = fields[key]
                items = node[key] = to_dict(f.default_factory() if callable(f.default_factory) else f.default)
            if not isinstance(items, list):
                raise ConfigError(f"{where}: expected a list, got {_describe(items)}")
            items = node[key] = list(items)  # a copy: a YAML alias may share the list with another key
            text = indexed.group(2)
            index = int(text) if text.isascii() and text.isdigit() and len(text) < 19 else -1
            if not 0 <= index < len(items):
                raise ConfigError(
                    f"{path}: index {clip(text)} is out of range: {where} has {len(items)} item(s)"
                    + (f" (indexes 0 to {len(items) - 1})" if items else "")
                    + f"; to add one, give the whole list: {where}=[...]"
                )
            (tp,) = typing.get_args(tp)
            if last:
                items[index] = value
                return
            if not isinstance(items[index], dict):
                raise ConfigError(f"{where}[{index}]: expected a mapping, got {_describe(items[index])}")
            child: dict = dict(items[index])
            items[index] = child
        else:
            if last:  # a section given whole merges into what is there, as a config file does; anything else is set
                merge = dataclasses.is_dataclass(tp) and isinstance(value, dict) and isinstance(node.get(key), dict)
                node[key] = _merge(node[key], value) if merge else value
                return
            child = node[key] if isinstance(node.get(key), dict) else {}
            node[key] = child
        cls, node = tp, child


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` -> (key, YAML-parsed value; the raw text when it is no YAML value)."""
    if "=" not in text:
        raise ConfigError(f"{clip(text)}: overrides look like key.sub=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"{clip(text)}: no key before '='; overrides look like key.sub=value, e.g. train.lr=1e-3")
    try:
        value = load_value(raw) if raw != "" else ""
    except ConfigError as e:  # an alias bomb: refused, not read as text
        raise ConfigError(f"{clip(key.strip())}: {e}") from None
    except (yaml.YAMLError, ValueError, TypeError, RecursionError):  # ValueError: e.g. a date 2001-13-45
        value = raw
    if isinstance(value, str) and " #" in raw and value != raw.strip() and " #" not in value:
        raise ConfigError(  # YAML reads " #" as a comment: a=runs #1 would be 'runs'
            f"{clip(key.strip())}: {quote(raw)} holds ' #', which YAML reads as the start of a comment; quote the "
            f"value for the shell and for YAML: '{key.strip()}=\"{clip(raw)}\"'"
        )
    return key.strip(), value


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), base: dict | None = None
) -> RunConfig:
    """Load YAML (or start from ``base``: a stored, resolved config, whose moved keys are migrated), apply dotted
    overrides, validate strictly. Without ``base`` the config is one as written, so a growth entry that gives
    ``at_step`` beside ``at_tokens`` or ``at_fraction`` is refused (a stored config records both)."""
    tree: dict = {} if base is None else migrate(base)
    if path is not None:
        p, where = Path(path), clip(path)
        if not_a(p):  # a FIFO, a directory, a device: never opened (reading a FIFO would block)
            raise ConfigError(f"{where}: the config file {not_a(p)}")
        if not os.path.isfile(p):  # (Path.is_file raises on a name too long)
            raise ConfigError(f"{where}: config file not found")
        loaded = read_yaml(p)
        if loaded is None:
            raise ConfigError(
                f"{where}: the config file is empty; write the keys to change (or {{}} for all "
                f"defaults), or leave the file out to use {DEFAULT_CONFIG.name}"
            )
        if not isinstance(loaded, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level, got a {type(loaded).__name__}")
        tree = _merge(tree, loaded)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    if base is not None:  # a stored config: its growth points may be resolved already
        stored = from_dict(tree)
        if overrides and _settings_fine(base):  # a conflict these overrides make (one an older version let
            stored.check_settings()  # through stays: its checkpoint still resumes)
        return stored
    cfg = _build(RunConfig, tree, "")
    cfg.check_as_written()
    return cfg.validate()


def overridden(overrides: list[str] | tuple[str, ...], section: str, key: str) -> list[Any]:
    """The values ``overrides`` give ``section.key``, in whichever form (``section.key=v`` or ``section={key: v}``),
    in order: for a command that must refuse a key whatever way it is written."""
    found = []
    for text in overrides:
        dotted, value = parse_override(text)
        if dotted == f"{section}.{key}":
            found.append(value)
        elif dotted == section and isinstance(value, dict) and key in value:
            found.append(value[key])
    return found


def _settings_fine(base: dict) -> bool:
    """Whether the stored config ``base`` passes :meth:`RunConfig.check_settings` (the task files aside: a
    resume's preflight checks those)."""
    try:
        cfg = from_dict(migrate(base))
        cfg.eval.tasks = []
        cfg.check_settings()
    except ConfigError:
        return False
    return True


def split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """First non-override argument is the config path; ``key=value`` items are overrides."""
    path, overrides = None, []
    for a in args:
        if "=" in a and not a.startswith("-"):
            overrides.append(a)
        elif path is None:
            path = a
        else:
            raise ConfigError(f"{clip(a)}: unexpected argument (one config file, then key=value overrides)")
    return path, overrides


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_hash(cfg: RunConfig) -> str:
    """Hash of the parts of the config that define the trajectory (not where things are stored)."""
    d = to_dict(cfg)
    d.pop("checkpoint", None)
    d.pop("tracking", None)
    d["cluster"] = {"num_workers": cfg.cluster.num_workers}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {"a.b": value} (lists are JSON-encoded), for MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out
