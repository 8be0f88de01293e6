"""Names of data sources in metrics (``val/<name>/loss``) and in MLflow's Datasets: a source's ``name``, else the
stem of its path (``data/web.jsonl`` -> ``web``, ``demo`` -> ``demo``, hub ``allenai/c4`` -> ``c4``)."""

from __future__ import annotations

import re
from pathlib import PurePosixPath

from pretrain.config.errors import ConfigError, quote

_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def source_name(path: str, name: str = "") -> str:
    """The metric name of a source with ``path`` and the configured ``name`` (empty: the path's stem, with
    characters MLflow metric keys do not take replaced by ``_``)."""
    if name:
        return name
    stem = PurePosixPath(path.rstrip("/").split("://")[-1]).stem or path
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "source"


def check_source_names(sources, val_sources) -> None:
    """Names are valid metric keys, unique within ``data.sources`` and within ``data.val_sources`` (only one of
    the two groups is logged per source: the val sources when there are any)."""
    for key, group in (("data.sources", sources), ("data.val_sources", val_sources)):
        seen: dict[str, str] = {}
        for i, s in enumerate(group):
            where = f"{key}[{i}].name"
            if s.name and not _NAME.fullmatch(s.name):
                raise ConfigError(f"{where}: {quote(s.name)}: use letters, digits, '_', '-' and '.' only")
            name = source_name(s.path, s.name)
            if name in seen:
                raise ConfigError(
                    f"{where}: {quote(name)} is also the name of {seen[name]}; "
                    "give the sources distinct names (set name)"
                )
            seen[name] = f"{key}[{i}]"
