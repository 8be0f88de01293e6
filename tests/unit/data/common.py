"""What the tests of ``pretrain/data`` share: documents and corpus files, data configs, batches and the layout
they come in, and what a stream emitted."""

from __future__ import annotations

import json
import random
from pathlib import Path

from pretrain.config import DataConfig, SourceConfig, layout
from pretrain.data import TrainBatches

WORDS = (
    "the a of to and in is that it for on with as was by be at this from or an are which but not have "
    "model data token stream packing river mountain garden window library engine signal theory "
    "naïve café Größe façade déjà señor smörgåsbord 東京 データ ☕ emoji🙂 tab\tseparated"
).split(" ")


T = 32


def make_docs(n: int, tag: str, seed: int = 0) -> list[str]:
    """Unique documents of very different lengths (some span several sequences)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        k = rng.choice([3, 5, 8, 12, 20, 40, 90]) if i % 17 else 250
        docs.append(f"{tag} {i}: " + " ".join(rng.choice(WORDS) for _ in range(k)))
    return docs


def write_txt(path: Path, docs: list[str], blank_every: int = 0) -> Path:
    lines = []
    for i, d in enumerate(docs):
        lines.append(d)
        if blank_every and i % blank_every == 0:
            lines.append("   ")  # blank lines of txt files are skipped silently
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def write_parquet(path: Path, texts: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": pa.array(texts, type=pa.string()), "n": list(range(len(texts)))}), path, row_group_size=97
    )
    return path


def data_cfg(*paths, **kw) -> DataConfig:
    base = dict(sources=[SourceConfig(path=str(p)) for p in paths], num_streams=4, val_holdout=0.0)
    base.update(kw)
    return DataConfig(**base)


def batches(cfg, tok, *, rank=0, world=1, G=8, kind="decoder", seed=7) -> TrainBatches:
    return TrainBatches(cfg, kind=kind, tokenizer=tok, plan=plan(cfg, world, G), rank=rank, seed=seed)


def plan(cfg, world: int, G: int, seq_len: int = T, val: int = 0):
    return layout(
        world_size=world, global_batch=G, micro_cap=G, num_streams=cfg.num_streams, seq_len=seq_len, val_sequences=val
    )


def steps(tb: TrainBatches, n: int) -> list[dict]:
    return [tb.next_step() for _ in range(n)]


def stream_tokens(all_steps: list[dict], owned: list[int], per_stream: int) -> dict[int, list[int]]:
    """Concatenated input_ids emitted by each stream over the given steps (decoder batches)."""
    out = {s: [] for s in owned}
    for b in all_steps:
        for j, s in enumerate(owned):
            for row in b["input_ids"][j * per_stream : (j + 1) * per_stream]:
                out[s].extend(row.tolist())
    return out


def complete_docs(tokens: list[int], tok) -> list[str]:
    """Decode the documents that lie completely inside an emitted token stream."""
    eos = tok.eos_token_id
    cuts = [i for i, t in enumerate(tokens) if t == eos]
    return [tok.decode(tokens[a + 1 : b]) for a, b in zip([-1, *cuts], cuts)][1:] if cuts else []


def rows(batch: dict) -> list[tuple]:
    return sorted(tuple(r) for r in batch["input_ids"].tolist())


def drain(tb: TrainBatches) -> int:
    n = 0
    try:
        while True:
            tb.next_step()
            n += 1
    except StopIteration:
        return n
