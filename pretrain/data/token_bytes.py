"""UTF-8 bytes each token id spells: the denominator of ``bits_per_byte`` (training's validation and
``./launch.sh eval`` alike; see :mod:`pretrain.model.score`). Byte-level BPE spells a byte a character;
SentencePiece-style vocabularies (Llama 2's) spell a space ``▁`` and a byte they lack ``<0xNN>`` (byte fallback);
the space such a tokenizer puts before a text's first word counts as one byte of it."""

from __future__ import annotations

import json
import re

import torch


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _decoders(tokenizer) -> list[dict]:
    """The decoder steps of a fast tokenizer (a ``Sequence`` flattened); empty for a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    out, stack = [], [json.loads(backend.to_str()).get("decoder") or {}]
    while stack:
        d = stack.pop()
        out.append(d)
        stack.extend(d.get("decoders") or [])
    return out


def _space_mark(steps: list[dict]) -> str | None:
    """The character a SentencePiece-style vocabulary writes for a space (``▁``: a ``Metaspace`` decoder, or a
    ``Replace`` of it by a space), or None."""
    for d in steps:
        if d.get("type") == "Metaspace":
            return d.get("replacement") or "\u2581"
        if d.get("type") == "Replace" and d.get("content") == " " and (d.get("pattern") or {}).get("String"):
            return d["pattern"]["String"]
    return None


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def token_byte_lengths(tokenizer, size: int) -> torch.Tensor:
    """(size,) int64: UTF-8 bytes each token id spells (0 for special tokens and unused ids)."""
    lengths = torch.zeros(size, dtype=torch.int64)
    special = {int(i) for i in tokenizer.all_special_ids if i is not None}
    added = set(tokenizer.get_added_vocab())
    steps = _decoders(tokenizer)
    byte_level = any(d.get("type") == "ByteLevel" for d in steps)
    byte_fallback = any(d.get("type") == "ByteFallback" for d in steps)
    space = _space_mark(steps)
    table = {c: b for b, c in _bytes_to_unicode().items()}
    for token, i in tokenizer.get_vocab().items():
        if not 0 <= i < size or i in special:
            continue
        if byte_fallback and _BYTE_TOKEN.fullmatch(token):
            lengths[i] = 1  # <0xE2>: one byte of a character the vocabulary lacks
        elif token in added:
            lengths[i] = len(token.encode("utf-8"))
        elif byte_level and all(c in table for c in token):
            lengths[i] = len(token)  # one character per byte
        elif space is not None:  # the piece itself, its space marks as spaces (decoded alone, a leading one is lost)
            lengths[i] = len(token.replace(space, " ").encode("utf-8"))
        else:
            lengths[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return lengths
