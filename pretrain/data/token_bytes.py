"""UTF-8 bytes each token id spells: the denominator of ``bits_per_byte`` (training's validation and
``./launch.sh eval`` alike; see :mod:`pretrain.model.score`)."""

from __future__ import annotations

import json

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


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    stack = [decoder]
    while stack:
        d = stack.pop()
        if d.get("type") == "ByteLevel":
            return True
        stack.extend(d.get("decoders") or [])
    return False


def token_byte_lengths(tokenizer, size: int) -> torch.Tensor:
    """(size,) int64: UTF-8 bytes each token id spells (0 for special tokens and unused ids)."""
    lengths = torch.zeros(size, dtype=torch.int64)
    special = {int(i) for i in tokenizer.all_special_ids if i is not None}
    added = set(tokenizer.get_added_vocab())
    byte_level = _is_byte_level(tokenizer)
    table = {c: b for b, c in _bytes_to_unicode().items()}
    for token, i in tokenizer.get_vocab().items():
        if not 0 <= i < size or i in special:
            continue
        if token in added:
            lengths[i] = len(token.encode("utf-8"))
        elif byte_level and all(c in table for c in token):
            lengths[i] = len(token)  # one character per byte
        else:
            lengths[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return lengths
