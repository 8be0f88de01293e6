"""A per-user cache of trained tokenizers: the tokenizer of an unchanged corpus is trained once and reused.

An entry lives in ``<cache root>/tokenizers/<key>/`` (:func:`pretrain.user_cache.cache_root`);
``PRETRAIN_TOKENIZER_CACHE=0`` turns the cache off.

The key (:func:`cache_key`) is a SHA-256 over what the trained tokenizer depends on:

* the tokenizer settings: vocab size, the kind (byte-level BPE), special tokens, ``min_frequency``, how many
  documents it is trained on and the seed of their mixture order, the holdout (held-out documents are left
  out), the bad-record policy, ``piece_chars``, the versions of this code and of ``tokenizers``;
* a cheap identity of the corpus, per training source: its name, format, text field, weight, and per file its
  absolute path, size and modification time (``mtime_ns``) — no file is read, so a changed file is a miss as
  soon as its size or mtime changes (editors and copies set both); for the built-in demo corpus, which is
  generated, the SHA-256 of its content (recorded next to it by :mod:`pretrain.data.demo_corpus`), so its
  identity is the same from every working directory and survives a rebuild of identical text.

Sources streamed from the hub have no cheap identity: their tokenizer is never cached. An entry is written into a
temporary directory and renamed into place (concurrent runs are safe: the first rename wins); ``meta.json``
records every file's SHA-256, so a corrupt or partial entry is ignored (and replaced by the next training).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from pretrain.config import DataConfig
from pretrain.user_cache import cache_root

CACHE_VERSION = 1
"""Bump when the training of a tokenizer (documents, trainer options) changes: older entries then miss."""
META = "meta.json"


def enabled() -> bool:
    return os.environ.get("PRETRAIN_TOKENIZER_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def _file_identity(path: str) -> dict:
    sha_file = Path(path).with_name(Path(path).name + ".sha256")
    from pretrain.data.demo_corpus import CORPUS_NAME

    if Path(path).name == CORPUS_NAME and sha_file.is_file():  # generated: identified by its content
        return {"demo_sha256": sha_file.read_text().strip()}
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def sources_identity(sources) -> list[dict] | None:
    """The cheap identity of resolved sources (:func:`pretrain.data.sources.training_sources`): per source its name,
    format, text field, weight, ``piece_chars`` and per file :func:`_file_identity`; None when a source has no cheap
    identity (streamed from the hub, or token shards, whose content the directory's size and mtime do not follow)."""
    out = []
    for src in sources:
        if src.format in ("hub", "shards"):
            return None
        out.append(
            {
                "name": src.name,
                "format": src.format,
                "text_field": src.text_field,
                "weight": src.weight,
                "piece_chars": src.piece_chars,
                "files": [_file_identity(f) for f in src.files],
            }
        )
    return out


def cache_key(cfg: DataConfig, settings: dict) -> str | None:
    """The key of the tokenizer ``cfg`` trains with ``settings`` (the trainer's own options), or None when the
    corpus has no cheap identity (a hub source). Resolves the sources (the demo corpus is built if missing)."""
    import tokenizers

    from pretrain.data.sources import training_sources

    sources = sources_identity(training_sources(cfg))
    if sources is None:
        return None
    spec = {
        "version": CACHE_VERSION,
        "tokenizers": tokenizers.__version__,
        "settings": settings,
        "vocab_size": cfg.tokenizer_vocab_size,
        "train_docs": cfg.tokenizer_train_docs,
        "val_holdout": cfg.val_holdout if not cfg.val_sources else 0.0,
        "bad_records": cfg.bad_records,
        "sources": sources,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lookup(key: str) -> tuple[Path, int] | None:
    """(entry directory, tokenizer length) of a complete, intact entry; None for a miss or a damaged entry."""
    entry = cache_root() / "tokenizers" / key
    try:
        meta = json.loads((entry / META).read_text())
        files = meta["files"]
        if not files or any(_sha256(entry / name) != digest for name, digest in files.items()):
            return None
        return entry, int(meta["length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def copy_entry(entry: Path, out_dir: Path) -> None:
    """The entry's tokenizer files into ``out_dir`` (a run keeps its own copy: runs stay self-contained)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in json.loads((entry / META).read_text())["files"]:
        shutil.copyfile(entry / name, out_dir / name)


def store(key: str, tok_dir: Path, length: int) -> Path | None:
    """Put the saved tokenizer in ``tok_dir`` into the cache under ``key`` (atomically); returns the entry, or
    None when the cache cannot be written (the run goes on: the cache is an optimisation)."""
    root = cache_root() / "tokenizers"
    entry = root / key
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}."))
        files = {}
        for f in sorted(tok_dir.iterdir()):
            if f.is_file():
                shutil.copyfile(f, tmp / f.name)
                files[f.name] = _sha256(tmp / f.name)
        (tmp / META).write_text(json.dumps({"key": key, "length": length, "files": files}, indent=1))
        if entry.exists():  # a damaged entry (lookup refused it): replace it
            stale = Path(tempfile.mkdtemp(dir=root, prefix=f".stale-{key}."))
            os.replace(entry, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, entry)
        tmp = None
        return entry
    except OSError:
        return None if lookup(key) is None else entry  # another run's rename won: fine
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run_tokenizer(cfg: DataConfig, out_dir: Path, say=print) -> int:
    """The tokenizer of a new run, saved into ``out_dir``: ``cfg.tokenizer`` copied, the token shards' tokenizer
    when the sources include shard directories (:mod:`pretrain.data.shards.compat`), or the trained BPE —
    from the cache when an intact entry has the key, else trained and cached. Returns its length (tokens)."""
    from pretrain.data.shards.compat import shards_tokenizer, tokenizer_vocab_size
    from pretrain.data.tokenizer import TRAINER_SETTINGS, load_or_train_tokenizer

    shard_tok = "" if cfg.tokenizer else shards_tokenizer(cfg)
    if shard_tok:  # token shards carry their tokenizer: the run takes it
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in Path(shard_tok).iterdir():
            if f.is_file():
                shutil.copyfile(f, out_dir / f.name)
        say(f"tokenizer: the token shards' ({shard_tok})")
        return tokenizer_vocab_size(out_dir)
    key = cache_key(cfg, TRAINER_SETTINGS) if enabled() and not cfg.tokenizer else None
    hit = lookup(key) if key else None
    entry: Path | None
    if hit is not None:
        entry, length = hit
        copy_entry(entry, out_dir)
        say(f"tokenizer: reused from cache {entry}")
        return length
    length = len(load_or_train_tokenizer(cfg, out_dir=out_dir))
    entry = store(key, out_dir, length) if key else None
    if entry is not None:
        say(f"tokenizer: trained ({length:,} tokens), cached in {entry}")
    return length
