"""``train --dry-run``: the checks a run starts with and its plan, without starting it.

The config is loaded and validated (by the CLI), then :func:`pretrain.driver.prepare.preflight` runs what any machine
can check of the job (checkpoint directory writable, given directories present, every local corpus source opened and
a prefix read, the holdout planned) and says in one line each what it leaves to the machines that will run it (GPU
driver, CPUs and GPUs for the worker layout, hub datasets: no network, ``HF_HUB_OFFLINE``). Then the plan is
printed: model and its parameter count (a shape-only model on the meta device), tokenizer (given, reused from the
cache, or to be trained), data, batch layout, steps, ZeRO stage, workers, the parallel layout and the memory per GPU
with a verdict against ``cluster.gpu_type`` (:mod:`pretrain.driver.memory_plan`), checkpoints, tracking. Nothing is
created: no run directory, no MLflow run, no Ray; the only file that may appear is the built-in demo corpus in
``data.cache_dir`` (a cache the run would build the same way).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from pretrain.config import RunConfig, make_plan
from pretrain.config.paths import resolve_paths
from pretrain.driver.budget import check_growth_stages, resolve_budget
from pretrain.driver.memory_plan import count_parameters
from pretrain.driver.memory_report import plan_rows
from pretrain.driver.prepare import _round_up, preflight
from pretrain.driver.resume import check_resume_from


def _tokenizer_line(cfg: RunConfig) -> tuple[str, int]:
    """(what the run will do for its tokenizer, its length or the target vocab size)."""
    d = cfg.data
    if cfg.model.init_from_hf and not d.tokenizer and (Path(cfg.model.init_from_hf) / "tokenizer.json").is_file():
        d.tokenizer = cfg.model.init_from_hf
    if d.tokenizer:
        path = Path(d.tokenizer) / "tokenizer.json"
        length = _length_of(path) if path.is_file() else 0
        return f"given: {d.tokenizer}" + (f" ({length:,} tokens)" if length else ""), length
    from pretrain.data.shards.compat import shards_tokenizer

    shard_tok = shards_tokenizer(d)
    if shard_tok:
        length = _length_of(Path(shard_tok) / "tokenizer.json")
        return f"the token shards': {shard_tok} ({length:,} tokens)", length
    from pretrain.data import tokenizer_cache
    from pretrain.data.tokenizer import TRAINER_SETTINGS

    if not tokenizer_cache.enabled():
        return (
            f"trained at start (byte-level BPE, {d.tokenizer_vocab_size:,} tokens; cache off)",
            d.tokenizer_vocab_size,
        )
    key = tokenizer_cache.cache_key(d, TRAINER_SETTINGS)
    hit = tokenizer_cache.lookup(key) if key else None
    if hit is not None:
        return f"reused from cache {hit[0]} ({hit[1]:,} tokens)", hit[1]
    why = "not cached yet" if key else "hub sources are not cached"
    return (
        f"trained at start on {d.tokenizer_train_docs:,} documents (byte-level BPE, {d.tokenizer_vocab_size:,} "
        f"tokens; {why})",
        d.tokenizer_vocab_size,
    )


def _length_of(tokenizer_json: Path) -> int:
    """Tokens of a saved tokenizer (vocabulary and added tokens), read from its JSON without loading it."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data.get("model", {}).get("vocab", {})
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    ids |= {t["id"] for t in data.get("added_tokens", [])}
    return len(ids)


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hugging Face libraries imported from here on never reach the network (the dry run opens no hub source)."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dry_run(cfg: RunConfig, config_path: str) -> int:
    """Check ``cfg`` as ``train`` would and print its plan; creates nothing. Returns the exit code (0)."""
    with _offline():
        return _dry_run(cfg, config_path)


def _dry_run(cfg: RunConfig, config_path: str) -> int:
    cfg = resolve_paths(cfg)
    skipped = preflight(cfg, probe=False)
    check_resume_from(cfg)  # checkpoint.resume_from: what `resume DIR` checks (the checkpoint's tokenizer, too)
    if cfg.model.init_from_hf:
        from pretrain.driver.prepare import _adopt_hf_model

        _adopt_hf_model(cfg)
        check_growth_stages(cfg)
    tok, length = _tokenizer_line(cfg)
    m, t, c = cfg.model, cfg.train, cfg.cluster
    if m.vocab_size == 0:
        m.vocab_size = _round_up(length, m.vocab_multiple)
    resolve_budget(cfg, say=lambda line: print(f"[pretrain] {line}", flush=True), announce=True).validate()
    plan = make_plan(cfg, c.num_workers)
    counts = count_parameters(cfg)
    total, body = counts.total, counts.body
    moe = f", MoE {cfg.moe.num_experts} experts top-{cfg.moe.top_k}" if getattr(cfg.moe, "num_experts", 0) else ""
    address = c.address or os.environ.get("RAY_ADDRESS", "")
    where = (
        "in this process (cluster.use_ray=false)"
        if not c.use_ray
        else "in this process (one worker: nothing for Ray to do; cluster.ray_for_one_worker=true runs it through "
        "an embedded local Ray)"
        if c.trains_in_process()
        else f"on the Ray cluster {address}"
        if address
        else "through an embedded local Ray"
    )
    uri = ""
    if cfg.tracking.enabled:
        from pretrain.train.tracking import shown_uri, tracking_uri

        uri = tracking_uri()
    sources = ", ".join(s.name or s.path for s in cfg.data.sources)
    val = (
        ", ".join(s.name or s.path for s in cfg.data.val_sources)
        if cfg.data.val_sources
        else f"{cfg.data.val_holdout:.2%} of the training documents held out"
        if cfg.data.val_holdout > 0
        else "none"
    )
    rows = [
        ("config", f"{cfg.name} ({config_path})"),
        (
            "model",
            f"{m.kind}, {m.num_layers} layers x {m.hidden_size}, {m.num_heads} heads"
            + (f" ({m.num_kv_heads} kv)" if m.num_kv_heads else "")
            + f", seq {m.max_seq_len}, "
            f"vocab {m.vocab_size:,}{moe}: {total / 1e6:,.2f}M parameters ({body / 1e6:,.2f}M without "
            f"embeddings)",
        ),
        ("tokenizer", tok),
        ("data", f"{sources}; validation: {val}"),
        ("batch", plan.describe().removeprefix("plan: ")),
        (
            "steps",
            f"{t.max_steps:,} ({t.max_steps * plan.tokens_per_step:,} tokens), lr {t.lr:g} {t.decay}, "
            f"warmup {t.warmup_steps}, "
            + (
                f"no validation ({cfg.no_validation()})"
                if cfg.no_validation()
                else f"validation every {t.val_every or t.max_steps} steps"
            ),
        ),
        ("engine", f"DeepSpeed ZeRO-{cfg.zero.stage}, precision {t.precision}, compile {t.compile}"),
        (
            "workers",
            f"{c.num_workers} x {c.cpus_per_worker:g} CPU{', GPU ' + c.use_gpu if c.use_gpu != 'no' else ''} {where}",
        ),
        *plan_rows(cfg, plan, counts),
        ("checkpoints", f"every {cfg.checkpoint.every_steps or t.max_steps} steps into {cfg.checkpoint.dir}/RUN_ID"),
        ("tracking", f"MLflow {shown_uri(uri)}" if uri else "off (tracking.enabled=false)"),
    ]
    print(
        "[pretrain] dry run: config valid; preflight passed (checkpoint directory writable, batch layout, "
        "paths, local corpus readable and split planned); nothing was started or created"
    )
    for line in skipped:
        print(f"[pretrain] dry run: not checked: {line}")
    for key, value in rows:
        print(f"  {key:<12} {value}")
    return 0
