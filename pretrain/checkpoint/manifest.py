"""The manifest of a committed checkpoint (``manifest.json``): one typed schema, written at commit and read by
resume, export, listing and MLflow registration. A manifest that lacks a field parses with that field's default
(which means what a writer that omits the field means); keys this version does not know are kept in ``extra``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

FORMAT_DEEPSPEED = "deepspeed"
"""The model and optimizer state are a DeepSpeed engine checkpoint (``ds/state``), one shard per rank."""
FORMAT_FULL = "full"
"""Full fp32 weights (``weights.safetensors``) and optionally AdamW moments (``optimizer.safetensors``): written
without an engine (derived runs); resumes on any worker count and expert layout."""
FORMATS = (FORMAT_DEEPSPEED, FORMAT_FULL)


@dataclass
class FileEntry:
    bytes: int | None
    """Size; None in a manifest that did not record it (checked for presence only)."""
    sha256: str


@dataclass
class Manifest:
    step: int
    world_size: int = 1
    """Workers that wrote the checkpoint (one data/RNG file each)."""
    format: str = FORMAT_DEEPSPEED
    """How the model state is stored: ``deepspeed`` or ``full`` (see the constants above)."""
    run_id: str = ""
    tokens_seen: int = 0
    config_hash: str = ""
    model_kind: str = ""
    moe_ep_size: int = 0
    """``parallel.expert`` (formerly ``moe.ep_size``) the experts were partitioned with; 0 for a dense model."""
    data_position: dict[str, Any] = field(default_factory=dict)
    """``global_sequences`` consumed and ``num_streams``."""
    rng: dict[str, Any] = field(default_factory=dict)
    """How the per-rank RNG states are stored and used (documentation for a reader of the directory)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``train/loss`` and the last validation metrics at this step."""
    files: dict[str, FileEntry] = field(default_factory=dict)
    """Every file of the checkpoint (relative POSIX path) with its size and sha256."""
    committed_at: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of a newer or older writer this version does not know (kept on a round trip)."""

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes or 0 for f in self.files.values())

    @property
    def global_sequences(self) -> int:
        return int(self.data_position.get("global_sequences", 0))

    def to_dict(self, with_files: bool = True) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("files", "extra")}
        if with_files:
            out["files"] = {k: dataclasses.asdict(v) for k, v in self.files.items()}
        return {**self.extra, **out}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Manifest:
        """Parse a manifest of any version; raises KeyError/TypeError/ValueError on a malformed one."""
        known = {f.name for f in dataclasses.fields(cls)} - {"files", "extra"}
        kwargs = {k: v for k, v in raw.items() if k in known}
        kwargs["step"] = int(raw["step"])
        for name in ("world_size", "tokens_seen", "moe_ep_size"):
            if name in kwargs:
                kwargs[name] = int(kwargs[name] or 0)
        if kwargs.get("format", FORMAT_DEEPSPEED) not in FORMATS:
            raise ValueError(f"unknown checkpoint format {kwargs['format']!r} (known: {', '.join(FORMATS)})")
        files = {
            str(k): FileEntry(None if v.get("bytes") is None else int(v["bytes"]), str(v["sha256"]))
            for k, v in (raw.get("files") or {}).items()
        }
        extra = {k: v for k, v in raw.items() if k not in known and k != "files"}
        return cls(**kwargs, files=files, extra=extra)
