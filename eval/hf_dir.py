"""A Hugging Face model directory opened for ``eval`` and ``generate``: its config, kind, model, tokenizer and our
export's metadata, or one line (:class:`ConfigError`, exit 2) saying why it cannot be opened.

A directory that does not load (a truncated or missing weights file, a config or tokenizer file that is not valid,
modeling code that is not ours, an architecture that is neither a causal nor a masked LM) is refused in one line. For
an export of this project the line names the first file that no longer matches the export's manifest
(``pretrain_export_manifest.json``: sizes), so the user knows what was damaged; a file the user changed on purpose
is not refused as long as the directory still loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.config import ConfigError
from pretrain.config.errors import clip
from pretrain.invocation import command


def is_hf_dir(path: Path) -> bool:
    """A directory with a ``config.json``, or with our export's manifest (an export whose ``config.json`` is gone is
    opened as one, so that the refusal names the missing file), that is not one of our checkpoint directories."""
    from pretrain.checkpoint.store import is_checkpoint_dir
    from pretrain.export.output import MANIFEST_FILE

    marked = (path / "config.json").is_file() or (path / MANIFEST_FILE).is_file()
    return marked and not is_checkpoint_dir(path)


def hf_kind(config: Any) -> str:
    """``decoder`` or ``encoder`` by the config's ``architectures``; ValueError for anything else."""
    archs = getattr(config, "architectures", None) or []
    if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json: architectures must be a list of class names, got {archs!r}")
    if any(a.endswith("ForMaskedLM") for a in archs):
        return "encoder"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return "decoder"
    raise ValueError(f"cannot tell decoder from encoder: architectures {archs} (need *ForCausalLM or *ForMaskedLM)")


def damaged_file(path: Path) -> str | None:
    """The first file of our export in ``path`` that is missing or not the size its manifest records, as a phrase;
    None when every file matches, or when there is no readable manifest (not our export)."""
    from pretrain.export.output import read_manifest

    try:
        manifest = read_manifest(path)
    except ConfigError:
        return None
    for name, (size, _) in sorted((manifest.files if manifest else {}).items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size:,} bytes, the export's manifest says {size:,}"
    return None


@dataclass
class HfDir:
    """An opened Hugging Face directory."""

    path: Path
    kind: str
    config: Any
    model: Any = None
    tokenizer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    """Our export's metadata (``pretrain_export.json``: its run's data config, seed, context); empty otherwise."""


def open_hf_dir(path: Path, who: str, *, need: str | None = None) -> HfDir:
    """Open ``path`` for the command ``who`` (``eval``, ``generate``): ConfigError, one line, for a directory that
    does not load. ``need``: the kind the command takes; a directory of the other kind is returned without its model
    and tokenizer (the caller refuses it in its own words)."""
    from transformers import AutoConfig, AutoTokenizer

    from pretrain.export.hf import METADATA_FILE, is_our_remote_code, load_exported
    from pretrain.export.output import MANIFEST_FILE

    try:
        remote = is_our_remote_code(path)  # ValueError: modeling code that is not ours
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=remote)
        kind = hf_kind(config)
    except Exception as e:  # noqa: BLE001 - transformers' config classes raise their own types for a bad field
        if isinstance(e, ConfigError):
            raise
        raise _refusal(path, who, e) from None
    out = HfDir(path=path, kind=kind, config=config)
    if need is not None and kind != need:
        return out
    try:
        ours = (path / METADATA_FILE).is_file() or (path / MANIFEST_FILE).is_file()
        out.model = load_exported(path, kind, ours=ours)
        out.tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=remote)
        meta_file = path / METADATA_FILE
        out.meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    except Exception as e:  # noqa: BLE001 - safetensors, tokenizers and json raise their own types for a bad file
        if isinstance(e, ConfigError):
            raise
        raise _refusal(path, who, e) from None
    return out


def usable_positions(config: Any, model: Any) -> int | None:
    """How many tokens the model takes in one sequence: ``max_position_embeddings``, less the positions a
    RoBERTa-style embedding keeps for padding (its position ids start at ``padding_idx + 1``, so RoBERTa's 514
    positions hold 512 tokens); None when the config does not say."""
    for module in model.modules() if model is not None else ():
        size = getattr(getattr(module, "position_embeddings", None), "num_embeddings", None)
        pad = getattr(module, "padding_idx", None)
        if hasattr(type(module), "create_position_ids_from_input_ids") and isinstance(pad, int) and size:
            return int(size) - pad - 1
    max_pos = getattr(config, "max_position_embeddings", None)
    return int(max_pos) if isinstance(max_pos, int) else None


def _refusal(path: Path, who: str, error: Exception) -> ConfigError:
    """The one line: the loader's own error, after the first file of our export that no longer matches its
    manifest when there is one (the likely cause, but a file the user changed on purpose may not be)."""
    first = (str(error).strip().splitlines() or [""])[0]
    said = f"{type(error).__name__}: {clip(first)}"
    damaged = damaged_file(path)
    if damaged:
        return ConfigError(
            f"{who}: {path}: {damaged}; export it again ({command()} export RUN_ID --out DIR). Loading said: {said}"
        )
    text = first if first.startswith(str(path)) else f"{path}: {first}"
    return ConfigError(f"{who}: {clip(text)} ({type(error).__name__})")
