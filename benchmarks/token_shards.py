"""``./launch.sh bench --data [--json] [--tiny] [--mb N]``: token shards against text.

* **Tokenize throughput**: the ``tokenize`` job (:mod:`pretrain.driver.tokenize`, a Ray Data job) over one corpus
  with 1 and then 2 Ray workers, on one Ray instance started first (its start-up is not counted; each job's actor
  start-up is). Tokens per second of wall time, the 2-worker speed-up, and whether both outputs are byte-identical.
* **Loader throughput**: :func:`pretrain.data.data_throughput` (one process, one thread, every virtual stream:
  documents -> packed batches) from the text and from its shards, with the same tokenizer; the ratio is the shard
  loader's speed-up per core. Two step layouts: a small one (8 streams, one 512-token sequence each: a step of
  4,096 tokens) and ``configs/gpt-125m.yaml``'s (its ``data.num_streams``, ``train.global_batch_size`` and
  ``model.max_seq_len``: 64 streams, 512 x 1,024 tokens). The text path reads every record once per stream; the
  shards' bulk path gathers a stream's documents from the index with no Python work per document.

The corpus is the built-in demo corpus repeated to ``--mb`` MB (a local file: no hub, no network); ``--tiny`` is a
half-MB corpus and short measurements, for the tests. Goals (docs/data.md): 2-worker tokenize >= 1.7x one worker;
shard loader >= 50x the text loader (in each layout).
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pretrain.config.errors import ArgumentParser

GOAL_TOKENIZE_SCALING = 1.7
GOAL_LOADER_RATIO = 50.0


def _corpus(dest: Path, megabytes: float) -> Path:
    from pretrain.data import build_demo_corpus

    demo = build_demo_corpus(dest / "demo").read_text(encoding="utf-8")
    path, target = dest / "corpus.txt", int(megabytes * 1e6)
    with open(path, "w", encoding="utf-8") as f:
        written, copy = 0, 0
        while written < target:  # each copy's lines tagged, so documents stay distinct
            block = "".join(f"{copy}: {line}\n" for line in demo.splitlines() if line.strip())
            f.write(block)
            written, copy = written + len(block.encode()), copy + 1
    return path


def _tokenize(corpus: Path, out: Path, tok_dir: Path, workers: int, chunk_bytes: int) -> tuple[float, dict]:
    from pretrain.driver.tokenize import tokenize

    args = [str(corpus), "--out", str(out), "--tokenizer", str(tok_dir), "--workers", str(workers)]
    start = time.perf_counter()
    tokenize([*args, "--chunk-bytes", str(chunk_bytes), "--shard-tokens", str(1 << 22)])
    return time.perf_counter() - start, json.loads((out / "manifest.json").read_text())


def _layouts(tiny: bool) -> list[tuple[str, int, int, int]]:
    """(name, streams, sequences a step, sequence length) of the loader measurements (see the module docstring);
    ``tiny``: the preset's streams with one 128-token sequence each."""
    from pretrain.config.loading import load_config

    preset = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "gpt-125m.yaml"), [])
    streams = preset.data.num_streams
    G, T = (streams, 128) if tiny else (preset.train.global_batch_size, preset.model.max_seq_len)
    return [("small", 8, 8, 512), ("gpt-125m", streams, G, T)]


def run(megabytes: float, seconds: float, tiny: bool = False) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    from cluster.launch import ensure_ray, stop_ray
    from pretrain.config import DataConfig, SourceConfig
    from pretrain.config.runtime import ClusterConfig
    from pretrain.data import data_throughput
    from pretrain.data.tokenizer_cache import run_tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        corpus = _corpus(work, megabytes)
        text_cfg = DataConfig(sources=[SourceConfig(path=str(corpus))], val_holdout=0.0, tokenizer_train_docs=20_000)
        tok_dir = work / "tokenizer"
        run_tokenizer(text_cfg, tok_dir, say=lambda line: print(f"[bench] {line}", file=sys.stderr))
        chunk = max(1 << 16, corpus.stat().st_size // 16)  # 16 units: both workers stay busy to the end
        started = ensure_ray(ClusterConfig())
        try:
            t1, m1 = _tokenize(corpus, work / "w1", tok_dir, 1, chunk)
            t2, m2 = _tokenize(corpus, work / "w2", tok_dir, 2, chunk)
        finally:
            stop_ray(started)
        identical = [s["sha256"] for s in m1["shards"] + m1["index"]] == [
            s["sha256"] for s in m2["shards"] + m2["index"]
        ]
        tok = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
        text_cfg.tokenizer = str(tok_dir)
        shard_cfg = DataConfig(sources=[SourceConfig(path=str(work / "w1"))], val_holdout=0.0, tokenizer=str(tok_dir))
        loader: dict[str, dict[str, Any]] = {}
        ratios: dict[str, float] = {}
        for name, streams, G, T in _layouts(tiny):
            text_cfg.num_streams = shard_cfg.num_streams = streams
            speed = {}
            for what, cfg in (("text", text_cfg), ("shards", shard_cfg)):
                speed[what] = data_throughput(
                    cfg, kind="decoder", seq_len=T, tokenizer=tok, seconds=seconds, global_batch=G
                )
            loader[name] = {
                "layout": f"{streams} streams, {G} x {T} tokens a step",
                "text_tokens_per_s": round(speed["text"]),
                "shards_tokens_per_s": round(speed["shards"]),
                "ratio": round(speed["shards"] / speed["text"], 2),
            }
            ratios[name] = speed["shards"] / speed["text"]
    tokens = int(m1["tokens"])
    return {
        "corpus_mb": megabytes,
        "tokens": tokens,
        "tokenize_1_worker_tokens_per_s": round(tokens / t1),
        "tokenize_2_workers_tokens_per_s": round(tokens / t2),
        "tokenize_scaling": round(t1 / t2, 3),
        "outputs_identical": identical,
        "loader": loader,
        "goals": {
            f"tokenize_scaling>={GOAL_TOKENIZE_SCALING}": t1 / t2 >= GOAL_TOKENIZE_SCALING,
            **{f"loader_ratio[{k}]>={GOAL_LOADER_RATIO:g}": r >= GOAL_LOADER_RATIO for k, r in ratios.items()},
        },
    }


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh bench --data", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", action="store_true", help="this benchmark")
    p.add_argument("--json", action="store_true", help="print one JSON object (on stdout; all else on stderr)")
    p.add_argument("--tiny", action="store_true", help="a half-MB corpus and short measurements (tests)")
    p.add_argument("--mb", type=float, default=32.0, help="corpus size in MB (default 32)")
    a = p.parse_args(argv)
    mb, seconds = (0.5, 0.5) if a.tiny else (a.mb, 5.0)
    with contextlib.redirect_stdout(sys.stderr):  # the jobs' progress lines: stdout keeps only the result
        result = run(mb, seconds, a.tiny)
    if a.json:
        print(json.dumps(result))
        return 0
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    return 0
