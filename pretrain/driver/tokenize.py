"""``./launch.sh tokenize SOURCE... --out DIR``: a corpus tokenized once into token shards, as a Ray Data job.

The job (see docs/data.md):

1. resolves the sources as training does (:func:`pretrain.data.sources.resolve_source`: txt, jsonl with
   ``--text-field``, parquet, directories, globs, hub names), checks them as training does before Ray starts
   (:func:`pretrain.data.sanity.check_source`: empty, not text, no usable record...), and the tokenizer
   (``--tokenizer`` a saved tokenizer directory or a run id; without it, the byte-level BPE a training run on these
   sources trains, with the data settings of ``--config`` or the defaults);
2. cuts the work into units (:mod:`pretrain.data.shards.units`) and tokenizes the units not done yet with
   ``ray.data.from_items(units).map_batches(TokenizeUnits, compute=ActorPoolStrategy(size=workers))`` on the
   embedded local Ray (or ``RAY_ADDRESS``); each unit writes its own part file, named by its number;
3. counts the bad records (``--bad-records skip``, reported with file and line) or refuses the first one
   (``fail``: exit 2, ``file:line: reason``), then assembles the parts in unit order into shards, the document index
   and the manifest (:mod:`pretrain.data.shards.writer`), and removes the parts.

The output depends only on the sources, the tokenizer and ``--shard-tokens``: the same bytes whatever the number of
workers. A rerun of the same command after a crash tokenizes only the units without a part and writes only the
shards that are missing. A directory that holds the output of another job is refused: nothing is overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.config import ConfigError, DataConfig, SourceConfig
from pretrain.config.errors import ArgumentParser, clip
from pretrain.config.tree import BYTE_LEVEL_VOCAB
from pretrain.data.shards.format import (
    DEFAULT_SHARD_TOKENS,
    TOKENIZER_DIR,
    dtype_for,
    is_shard_dir,
    load_manifest,
    tokenizer_hash,
)
from pretrain.data.shards.units import DEFAULT_CHUNK_BYTES, Unit, plan_units, tokenize_unit, unit_done
from pretrain.driver.tokenize_job import JOB_FILE, WORK_DIR, check_out, job_spec, read_job, same_job
from pretrain.invocation import command


def parse(args: list[str]) -> argparse.Namespace:
    p = ArgumentParser(
        prog="launch.sh tokenize",
        description="Tokenize SOURCEs once into memory-mapped token shards (a Ray Data job); train on them with "
        "data.sources=[{path: DIR}].",
    )
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="a file, directory, glob or hub name (as data.sources)")
    p.add_argument("--out", required=True, help="the output directory (created; its manifest is written last)")
    p.add_argument("--tokenizer", default="", help="a saved tokenizer directory or a run id (default: train a BPE)")
    p.add_argument(
        "--config",
        default="",
        help="a training config: the BPE is trained as a run of it on these SOURCEs trains its own (its "
        "data.tokenizer_vocab_size, tokenizer_train_docs, val_holdout and val_sources; its data.tokenizer if set)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help=f"of a trained BPE (default: --config's, else {DataConfig.tokenizer_vocab_size})",
    )
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard")
    p.add_argument("--workers", type=int, default=0, help="Ray Data tokenizing actors (default: the cluster's CPUs)")
    p.add_argument(
        "--format",
        choices=("auto", "text", "json", "parquet"),
        default="auto",
        help="the format of every SOURCE's files (default auto: from each file's extension)",
    )
    p.add_argument("--text-field", default="text", help="the text field of json/parquet/hub records")
    p.add_argument(
        "--bad-records",
        choices=("skip", "fail"),
        default=None,
        help="as data.bad_records (default: --config's, else skip)",
    )
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="bytes of txt/jsonl per unit")
    a = p.parse_args(args)
    for name in ("shard_tokens", "chunk_bytes"):
        if getattr(a, name) <= 0:
            raise ConfigError(f"tokenize --{name.replace('_', '-')}: must be > 0, got {getattr(a, name)}")
    if a.workers < 0:
        raise ConfigError(f"tokenize --workers: must be >= 0, got {a.workers}")
    if a.vocab_size < 0:
        raise ConfigError(f"tokenize --vocab-size: must be > 0, got {a.vocab_size}")
    base = _trained_like(a.config)
    a.tokenizer = a.tokenizer or base.tokenizer
    a.vocab_size = a.vocab_size or base.tokenizer_vocab_size
    a.bad_records = a.bad_records or (base.bad_records if a.config else "skip")
    if not a.tokenizer and a.vocab_size < BYTE_LEVEL_VOCAB:
        raise ConfigError(
            f"tokenize --vocab-size: at least {BYTE_LEVEL_VOCAB} (a byte-level BPE's 256 bytes and its special "
            f"tokens), got {a.vocab_size}"
        )
    return a


def _absolute(path: str) -> str:
    """A local path (or glob) made absolute, so that the manifest and a rerun name the same files from anywhere."""
    local = os.path.exists(os.path.expanduser(path)) or any(c in path for c in "*?[")
    return os.path.abspath(os.path.expanduser(path)) if local and "://" not in path else path


def _trained_like(config: str) -> DataConfig:
    """The data settings the trained BPE follows: ``--config``'s data section, else the defaults."""
    if not config:
        return DataConfig()
    from pretrain.config import load_config
    from pretrain.config.paths import resolve_paths

    return resolve_paths(load_config(config, [])).data


def _data_config(a: argparse.Namespace) -> DataConfig:
    """The job's sources (the command's) with the tokenizer settings of :func:`_trained_like`."""
    sources = [SourceConfig(path=_absolute(p), text_field=a.text_field, format=a.format) for p in a.sources]
    base = _trained_like(a.config)
    return dataclasses.replace(
        base, sources=sources, bad_records=a.bad_records, tokenizer_vocab_size=a.vocab_size, tokenizer=""
    )


def _tokenizer_dir(a: argparse.Namespace, cfg: DataConfig, reuse: Path | None, scratch: Path) -> Path:
    """The tokenizer the job uses, as a directory: --tokenizer (a directory, or a run's); else the one an unfinished
    job trained (``reuse``, when it holds one), else one trained into ``scratch`` (from the user's tokenizer cache
    when a run trained it already)."""
    if a.tokenizer:
        path = Path(a.tokenizer).expanduser()
        if not path.exists():
            from pretrain.checkpoint import layout
            from pretrain.train import tracking

            if tracking.names_a_path(a.tokenizer):
                raise ConfigError(f"tokenize --tokenizer: {clip(a.tokenizer)}: no such directory")
            path = tracking.run_checkpoint_root(tracking.tracking_uri(), a.tokenizer) / layout.RUN_TOKENIZER
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"tokenize --tokenizer: {clip(str(path))} holds no tokenizer.json (a fast tokenizer)")
        return path
    from pretrain.data.tokenizer_cache import run_tokenizer

    if reuse is not None and (reuse / "tokenizer.json").is_file():
        return reuse
    out = scratch / TOKENIZER_DIR
    run_tokenizer(cfg, out, say=lambda line: print(f"[tokenize] {line}", flush=True))
    return out


class TokenizeUnits:
    """A Ray Data actor: the tokenizer loaded once, then one unit per row (``{"unit": json}``) tokenized into its
    part file; returns each unit's summary as JSON."""

    def __init__(self, sources: list[dict], tokenizer_dir: str, work: str, vocab_size: int):
        from transformers import PreTrainedTokenizerFast

        from pretrain.data.sources import ResolvedSource
        from pretrain.data.tokenizer import make_encoder

        self.sources = [ResolvedSource(**s) for s in sources]
        self.encode = make_encoder(PreTrainedTokenizerFast.from_pretrained(tokenizer_dir))
        self.work, self.vocab_size = Path(work), vocab_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        out = []
        for raw in batch["unit"]:
            unit = Unit(**json.loads(str(raw)))
            summary = tokenize_unit(unit, self.sources[unit.source], self.encode, self.work, self.vocab_size)
            out.append(json.dumps(summary))
        return {"summary": out}


def _run_units(pending: list[Unit], sources, tok_dir: Path, work: Path, vocab: int, workers: int, total: int) -> None:
    """The pending units tokenized by a Ray Data job, with a progress line as units finish."""
    from cluster.launch import ensure_ray, stop_ray
    from pretrain.config.runtime import ClusterConfig

    started = ensure_ray(ClusterConfig())  # before Ray's first import: it keeps an embedded Ray on 127.0.0.1
    import ray
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.ERROR)  # its plan and start/finish lines: ours say more
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.verbose_stats_logs = False
        size = workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
        size = min(size, len(pending))
        print(f"[tokenize] {len(pending)} of {total} unit(s) to do, {size} Ray Data worker(s)", flush=True)
        items = [{"unit": json.dumps(asdict(u))} for u in pending]
        ds = ray.data.from_items(items, override_num_blocks=len(pending)).map_batches(
            TokenizeUnits,
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=size),
            fn_constructor_kwargs={
                "sources": [asdict(s) | {"_shards": None} for s in sources],
                "tokenizer_dir": str(tok_dir),
                "work": str(work),
                "vocab_size": vocab,
            },
            num_cpus=1,
        )
        t0, done, tokens = time.perf_counter(), total - len(pending), 0
        for row in ds.iter_rows():
            summary = json.loads(row["summary"])
            done, tokens = done + 1, tokens + summary["tokens"]
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            print(f"[tokenize] {done}/{total} units, {tokens:,} tokens, {rate:,.0f} tokens/s", flush=True)
    finally:
        stop_ray(started)


def _bad_records(units: list[Unit], summaries: list[dict], sources, policy: str) -> dict[str, Any]:
    """The bad records of all units with lines counted from their file's start, summarized as training does; under
    ``fail`` the first (in document order) raises :class:`BadRecordError`."""
    from pretrain.data.bad_records import BadRecords, summarize_bad_records

    counter, offsets = BadRecords(policy), dict[tuple[int, str], int]()
    names = _source_names(sources)
    for unit, summary in zip(units, summaries, strict=True):
        key = (unit.source, unit.file or "")  # a file listed twice is two sources, each counting from its line 1
        offset = offsets.get(key, 0) if unit.file else 0
        for file, line, reason, msg in summary["bad"]:
            counter.add(
                {
                    "file": file,
                    "line": line + offset if isinstance(line, int) else line,
                    "bad": reason,
                    "msg": msg,
                    "source": names[unit.source],
                }
            )
        if unit.file:
            offsets[key] = offset + summary["lines"]
    return summarize_bad_records([counter])


def _source_names(sources) -> list[str]:
    """Each source's name, numbered where the same one is given more than once (oversampling by repetition)."""
    names = [s.name for s in sources]
    return [f"{n} (source {i + 1})" if names.count(n) > 1 else n for i, n in enumerate(names)]


def tokenize(args: list[str]) -> int:
    from cluster.requires import require_ray
    from pretrain.data.bad_records import refuse_skipped, summary_line
    from pretrain.data.fingerprint import source_fingerprint
    from pretrain.data.sanity import check_source
    from pretrain.data.shards.compat import tokenizer_vocab_size
    from pretrain.data.shards.writer import assemble, write_atomic
    from pretrain.data.sources import resolve_source

    a = parse(args)
    require_ray(f"{command()} tokenize", "it tokenizes with Ray Data (an embedded one on this machine); ")
    out = Path(a.out).expanduser().resolve()
    check_out(out)
    cfg = _data_config(a)
    keys = [f"tokenize SOURCE[{i}]" for i in range(len(cfg.sources))]
    sources = [
        resolve_source(s, cfg.cache_dir, k, format_option="--format") for s, k in zip(cfg.sources, keys, strict=True)
    ]
    for key, s, src in zip(keys, sources, cfg.sources, strict=True):
        if s.format == "shards":
            raise ConfigError(f"{key}: {clip(src.path)} holds token shards already (train on it directly)")
        check_source(src, key, cfg, format_option="--format")  # training's corpus checks, before Ray
    # Nothing is written into --out before the job is known to be new or this one unfinished: a refusal or a
    # "done already" leaves it as it was (a tokenizer trained to compare with goes to a temporary directory).
    work, finished = out / WORK_DIR, is_shard_dir(out)
    with tempfile.TemporaryDirectory(prefix="pretrain-tokenize-") as scratch:
        tok_dir = _tokenizer_dir(a, cfg, None if finished else work / TOKENIZER_DIR, Path(scratch))
        tok_hash, vocab = tokenizer_hash(tok_dir), tokenizer_vocab_size(tok_dir)
        try:
            dtype = dtype_for(vocab)
        except ValueError as e:
            raise ConfigError(f"tokenize --tokenizer: {e}") from None
        job_file = work / JOB_FILE
        recorded = load_manifest(out).job if finished else read_job(job_file)
        spec = job_spec(a, cfg, sources, tok_hash, recorded)
        if finished:
            done = load_manifest(out)
            if not same_job(done.job, spec):
                raise ConfigError(
                    f"tokenize --out: {clip(str(out))} holds the token shards of other sources or settings; give a "
                    "new directory (nothing was overwritten)"
                )
            refuse_skipped(done.bad_records, a.bad_records, clip(str(out)))
            print(f"[tokenize] {out}: done already ({done.tokens:,} tokens, {done.documents:,} documents)", flush=True)
            return 0
        if job_file.is_file() and not same_job(json.loads(job_file.read_text()), spec):
            raise ConfigError(
                f"tokenize --out: {clip(str(out))} holds an unfinished job of other sources or settings; give a new "
                f"directory, or remove {clip(str(out))} (what an unfinished job wrote: nothing else is in it)"
            )
        work.mkdir(parents=True, exist_ok=True)
        write_atomic(job_file, json.dumps(spec, indent=1).encode())  # first: it makes --out a job's (check_out)
        if tok_dir.parent == Path(scratch):  # trained now: kept with the job, which a rerun after a crash reuses
            staged = work / f".{TOKENIZER_DIR}-{os.getpid()}"  # whole or not at all (a rerun reuses what is there)
            shutil.rmtree(staged, ignore_errors=True)
            shutil.copytree(tok_dir, staged)
            shutil.rmtree(work / TOKENIZER_DIR, ignore_errors=True)
            os.replace(staged, work / TOKENIZER_DIR)
            tok_dir = work / TOKENIZER_DIR

    units = plan_units(sources, a.chunk_bytes)
    pending = [u for u in units if unit_done(work, u) is None]
    if pending:
        _run_units(pending, sources, tok_dir, work, vocab, a.workers, len(units))
    summaries = []
    for u in units:
        summary = unit_done(work, u)
        if summary is None:
            raise RuntimeError(f"tokenize: unit {u.index} has no part after the job")
        summaries.append(summary)
    bad = _bad_records(units, summaries, sources, a.bad_records)
    if bad["total"]:
        print(f"[tokenize] {summary_line(bad)}", flush=True)

    per_source: list[dict[str, Any]] = []
    names = _source_names(sources)
    for i, (s, src) in enumerate(zip(sources, cfg.sources, strict=True)):
        mine = [x for u, x in zip(units, summaries, strict=True) if u.source == i]
        per_source.append(
            {
                "path": src.path,
                "format": s.format,
                "text_field": s.text_field,
                "fingerprint": source_fingerprint(src, cfg.cache_dir),
                "documents": sum(x["documents"] for x in mine),
                "tokens": sum(x["tokens"] for x in mine),
                "bad_records": bad["by_source"].get(names[i], 0),
            }
        )
    manifest = assemble(
        out,
        work,
        units,
        dtype=dtype,
        shard_tokens=a.shard_tokens,
        tokenizer_dir=tok_dir,
        tokenizer={"sha256": tok_hash, "vocab_size": vocab},
        sources=per_source,
        bad_records=bad,
        job=spec,
        say=lambda line: print(f"[tokenize] {line}", flush=True),
    )
    shards, tokens, documents = manifest.shards, manifest.tokens, manifest.documents
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"[tokenize] {out}: {tokens:,} tokens ({dtype}), {documents:,} documents, {len(shards)} shard(s); train on it "
        f"with data.sources=[{{path: {out}}}]",
        flush=True,
    )
    return 0
