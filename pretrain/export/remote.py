"""The bundled ``trust_remote_code`` model (``remote_code/modeling_pretrain.py``): the ``auto_map`` an export of it
writes, and whether a directory's remote code is exactly that export's, so that it may run.

A directory is trusted only when everything ``transformers`` would import from it is our bundled file, unchanged:
its ``config.json`` names our model type and maps the auto classes to our module exactly as export writes them,
its ``tokenizer_config.json`` maps no auto class (export writes none), its ``modeling_pretrain.py`` is
byte-identical to this version's, and it holds no other Python file, no ``custom_generate`` and no linked
directory (``transformers`` imports any module an ``auto_map`` names and runs ``custom_generate/generate.py`` when
remote code is trusted). A directory of our model type that fails any of these is refused (ValueError, one line);
any other directory gets no remote code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pretrain.config.errors import quote
from pretrain.export.hf_import import REMOTE_MODEL_TYPE

REMOTE_CODE_DIR = Path(__file__).resolve().parent / "remote_code"
REMOTE_MODULE = "modeling_pretrain"
REMOTE_CLASSES = {"decoder": "PretrainTransformerForCausalLM", "encoder": "PretrainTransformerForMaskedLM"}


def remote_auto_map(kind: str) -> dict[str, str]:
    """The ``auto_map`` of the config of a remote-code export of a ``kind`` (``decoder`` or ``encoder``) model."""
    auto = "AutoModelForCausalLM" if kind == "decoder" else "AutoModelForMaskedLM"
    return {
        "AutoConfig": f"{REMOTE_MODULE}.PretrainTransformerConfig",
        auto: f"{REMOTE_MODULE}.{REMOTE_CLASSES[kind]}",
    }


def _read_json(path: Path) -> Any:
    """The JSON in ``path``; None when it is missing or not valid JSON (the loader reports that itself)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def _untrusted(path: Path, cfg: dict[str, Any]) -> str | None:
    """Why the remote code of ``path`` (config ``cfg``, of our model type) is not exactly our export's; None when it
    is."""
    if cfg.get("auto_map") not in [remote_auto_map(kind) for kind in REMOTE_CLASSES]:
        return f"config.json's auto_map is not the one export writes ({quote(cfg.get('auto_map'))})"
    tokenizer_cfg = _read_json(path / "tokenizer_config.json")
    if isinstance(tokenizer_cfg, dict) and "auto_map" in tokenizer_cfg:
        return "tokenizer_config.json has an auto_map (export writes none)"
    ours = path / f"{REMOTE_MODULE}.py"
    if not ours.is_file() or ours.read_bytes() != (REMOTE_CODE_DIR / f"{REMOTE_MODULE}.py").read_bytes():
        return f"{REMOTE_MODULE}.py is missing or differs from this version's"
    others, linked = [], []
    for top, dirs, files in os.walk(path):  # symlinked directories listed, not followed (rglob skips them)
        for name in dirs + files:
            entry = Path(top) / name
            if name == "custom_generate" or (name in dirs and entry.is_symlink()):
                linked.append(str(entry.relative_to(path)))
            elif name.endswith(".py") and entry != ours:
                others.append(str(entry.relative_to(path)))
    if linked:
        return f"it holds a custom_generate or a linked directory ({', '.join(sorted(linked)[:3])})"
    others.sort()
    if others:
        return f"it holds other Python files ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
    return None


def is_our_remote_code(path: Path) -> bool:
    """Whether ``path`` is a remote-code export of this project whose code may run (module doc): False for a
    directory of another model type (loaded without remote code); ValueError, one line, for one of ours whose code
    is not exactly the export's (never run foreign code just because a directory asks)."""
    path = Path(path)
    cfg = _read_json(path / "config.json")
    if not isinstance(cfg, dict) or cfg.get("model_type") != REMOTE_MODEL_TYPE:
        return False
    why = _untrusted(path, cfg)
    if why:
        raise ValueError(
            f"{path}: refusing to run its code: {why} (load it yourself with trust_remote_code=True if you trust it)"
        )
    return True
