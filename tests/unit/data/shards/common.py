"""Building a token-shard directory in-process (the units and the writer the tokenize job uses, without Ray)."""

from __future__ import annotations

from pathlib import Path

from pretrain.config import SourceConfig
from pretrain.data.shards.format import Manifest, dtype_for, tokenizer_hash
from pretrain.data.shards.units import plan_units, tokenize_unit
from pretrain.data.shards.writer import assemble
from pretrain.data.sources import resolve_source
from pretrain.data.tokenizer import make_encoder


def build_shards(
    out: Path,
    paths: list[Path],
    tok,
    tok_dir: Path,
    *,
    shard_tokens: int = 1000,
    chunk_bytes: int = 4096,
    text_field: str = "text",
) -> Manifest:
    """``paths`` tokenized with ``tok`` (saved in ``tok_dir``) into ``out``, unit by unit in reverse order."""
    sources = [resolve_source(SourceConfig(path=str(p), text_field=text_field), ".") for p in paths]
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    units = plan_units(sources, chunk_bytes)
    encode = make_encoder(tok)
    for u in reversed(units):  # any order: the parts are assembled in unit order
        tokenize_unit(u, sources[u.source], encode, work, len(tok))
    return assemble(
        out,
        work,
        units,
        dtype=dtype_for(len(tok)),
        shard_tokens=shard_tokens,
        tokenizer_dir=tok_dir,
        tokenizer={"sha256": tokenizer_hash(tok_dir), "vocab_size": len(tok)},
        sources=[{"path": str(p)} for p in paths],
        say=lambda line: None,
    )
