"""The run's tokenizer and the token shards it trains on: they must be the same tokenizer.

A run whose sources include token-shard directories takes their tokenizer (kept in each directory's
``tokenizer/``) unless ``data.tokenizer`` names one; every shard directory must have been made with the same
tokenizer, and a ``data.tokenizer`` must be it (same sha256 of its ``tokenizer.json``, same vocabulary size).
Anything else is refused in one line, on the driver, before Ray or a worker starts.
"""

from __future__ import annotations

from pathlib import Path

from pretrain.config import ConfigError, DataConfig
from pretrain.config.errors import clip
from pretrain.data.shards.format import TOKENIZER_DIR, load_manifest, tokenizer_hash


def tokenizer_vocab_size(tokenizer_dir: str | Path) -> int:
    """The vocabulary size of a saved fast tokenizer, added tokens included (``len(tokenizer)``)."""
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).get_vocab_size(with_added_tokens=True))


def shard_dirs(cfg: DataConfig) -> list[tuple[str, str]]:
    """(config key, directory) of every training and validation source that is a token-shard directory."""
    from pretrain.data.sources import resolve_source

    out = []
    for key, group in (("data.sources", cfg.sources), ("data.val_sources", cfg.val_sources)):
        for i, src in enumerate(group):
            if src.path == "demo":
                continue
            rs = resolve_source(src, cfg.cache_dir, f"{key}[{i}]")
            if rs.format == "shards":
                out.append((f"{key}[{i}]", rs.files[0]))
    return out


def shards_tokenizer(cfg: DataConfig) -> str:
    """The tokenizer directory of the run's token shards ('' when it has none); refuses shard directories made with
    different tokenizers, and a ``data.tokenizer`` that is not theirs."""
    dirs = shard_dirs(cfg)
    if not dirs:
        return ""
    first_key, first = dirs[0]
    want = load_manifest(first).tokenizer
    for key, d in dirs[1:]:
        got = load_manifest(d).tokenizer
        if got != want:
            raise ConfigError(
                f"{key}: the shards in {clip(d)} were made with another tokenizer than {first_key}'s "
                f"(sha256 {str(got.get('sha256'))[:12]}... vs {str(want.get('sha256'))[:12]}...); tokenize both "
                "with one --tokenizer"
            )
    if cfg.tokenizer:
        found = {"sha256": tokenizer_hash(cfg.tokenizer), "vocab_size": tokenizer_vocab_size(cfg.tokenizer)}
        for k in ("vocab_size", "sha256"):
            if found[k] != want.get(k):
                show = (lambda v: f"{v:,}") if k == "vocab_size" else (lambda v: f"{str(v)[:12]}...")
                raise ConfigError(
                    f"data.tokenizer: {clip(cfg.tokenizer)} is not the tokenizer of the shards in {clip(first)} "
                    f"({first_key}): {k} {show(found[k])}, the manifest says {show(want.get(k))}; leave "
                    "data.tokenizer empty to use theirs"
                )
        return cfg.tokenizer
    tok = Path(first) / TOKENIZER_DIR
    if not (tok / "tokenizer.json").is_file():
        raise ConfigError(f"{first_key}: {clip(str(tok))} is missing: the shards' tokenizer (tokenize again)")
    return str(tok)
