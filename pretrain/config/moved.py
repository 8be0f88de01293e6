"""Config keys that moved. A user's config (a YAML file or a dotted override) naming an old key is refused in one
line naming the new one (exit 2); a config stored by an older version (the resolved config in a checkpoint or run
directory) is migrated silently by :func:`migrate`, so old checkpoints still load and resume."""

from __future__ import annotations

import json
from typing import Any

from pretrain.config.errors import ConfigError

MOVED: dict[str, str] = {
    "cluster.sequence_parallel": "parallel.sequence",
    "cluster.tensor_parallel": "parallel.tensor",
    "moe.ep_size": "parallel.expert",
}
"""Old dotted key -> new dotted key."""


def check_key(section: str, key: str) -> None:
    """Refuse ``section.key`` (``section`` the dotted path of its section, "" at the top) if it moved."""
    old = f"{section}.{key}" if section else key
    if old in MOVED:
        raise ConfigError(f"{old}: moved; use {MOVED[old]}")


def migrate(stored: Any) -> Any:
    """A stored config (plain data) with every moved key under its new name (a copy; ``stored`` unchanged). A new key
    already present wins over the old one."""
    if not isinstance(stored, dict):
        return stored
    out = json.loads(json.dumps(stored))
    for old, new in MOVED.items():
        section, key = old.split(".")
        node = out.get(section)
        if not isinstance(node, dict) or key not in node:
            continue
        value = node.pop(key)
        new_section, new_key = new.split(".")
        target = out.setdefault(new_section, {})
        if isinstance(target, dict):
            target.setdefault(new_key, value)
    return out
