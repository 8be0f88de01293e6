"""Self-speculative (early-exit) decoding against plain greedy decoding of one model, on held-out prompts.

    ./launch.sh bench --early-exit --model RUN_ID|CHECKPOINT|HF_DIR [--exits 1,2,...] [--prompts 50]
                      [--prompt-tokens 16] [--max-new-tokens 32] [--draft-tokens N] [--draft-confidence P]
                      [--cli-prompts 3] [--data PATH ...] [--device D] [--json]
    ./launch.sh bench --early-exit [--tokens N] [--seed S] [--study-dir DIR] [--reuse DIR,...] [decoding options]
                      [key=value ...]

Without ``--model``: the study (:mod:`benchmarks.early_exit_study`), a decoder trained without and with the
early-exit loss at equal training FLOPs, then this benchmark on the early-exit model.

Prompts: the first ``--prompt-tokens`` tokens of ``--prompts`` held-out sequences (the model's run's validation set,
read as ``eval`` reads it, or ``--data``), decoded to text; each is encoded again as ``generate`` encodes a prompt.
Every prompt is decoded greedily, plainly and self-speculatively at each exit E (default: every E below the depth),
in-process through ``transformers``' ``generate`` (:mod:`eval.generate`, one untimed warm-up call first; the modes
alternate prompt by prompt, each mode first on as many prompts as the others, so that load on the machine and the
order of the calls fall on all of them). Per mode: tokens/s = all new tokens /
all seconds; per exit: the speedup over plain greedy, how many prompts decode identically token for token, and the
acceptance rate pooled over the prompts (accepted / drafted, :mod:`eval.generate`). The best exit is the fastest one
whose every output is identical. Then ``--cli-prompts`` prompts go through ``./launch.sh generate --early-exit BEST
--json`` (a subprocess: the user's path), whose plain and self-speculative continuations must both equal the
in-process plain greedy one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from pretrain.config import ConfigError


def heldout_prompts(gen, n: int, prompt_tokens: int, data: list[str]) -> list[str]:
    """``n`` prompt texts: the first ``prompt_tokens`` tokens of held-out sequences of ``gen``'s run or of ``data``."""
    from eval.sources import data_config_of
    from pretrain.data import validation_batches

    dcfg = data_config_of(gen.data, gen.label, data)
    if dcfg.val_holdout <= 0 and not dcfg.val_sources:
        raise ConfigError(f"bench --early-exit: {gen.label}: its run has no held-out data (val_holdout 0); pass --data")
    seq_len = min(gen.context, max(2 * prompt_tokens, 16))
    batches = validation_batches(
        dcfg, kind="decoder", seq_len=seq_len, tokenizer=gen.tokenizer, val_sequences=n, micro_batch=n, seed=gen.seed
    )
    texts = [gen.tokenizer.decode(seq[:prompt_tokens].tolist()) for b in batches for seq in b["input_ids"]]
    texts = [t for t in texts if gen.tokenizer(t, add_special_tokens=False)["input_ids"]]
    if len(texts) < n:
        raise ConfigError(f"bench --early-exit: the held-out data gives {len(texts)} prompts, fewer than --prompts {n}")
    return texts[:n]


def decoding_benchmark(
    gen,
    prompts: list[str],
    exits: list[int],
    *,
    max_new_tokens: int = 32,
    draft_tokens: int | None = None,
    draft_confidence: float | None = None,
) -> dict[str, Any]:
    """Plain greedy and self-speculative greedy at each of ``exits`` on every prompt (module docstring)."""
    from eval.generate import check_early_exit, decode, encode_prompt

    for e in exits:
        check_early_exit(gen, e)
    encoded = [encode_prompt(gen, p) for p in prompts]
    decode(gen, encoded[0], 2)  # warm-ups, untimed: plain and each exit
    for e in exits:
        decode(gen, encoded[0], 2, early_exit=e, draft_tokens=draft_tokens, draft_confidence=draft_confidence)
    totals: dict[str, dict[str, Any]] = {"greedy": {"tokens": 0, "seconds": 0.0}}
    for e in exits:
        totals[str(e)] = {"tokens": 0, "seconds": 0.0, "identical_prompts": 0, "drafted": 0, "accepted": 0}
    plain_texts = []
    modes: list[int | None] = [None, *exits]  # None: plain greedy
    for k, ids in enumerate(encoded):
        n = min(max_new_tokens, gen.context - len(ids))
        out: dict[int | None, Any] = {}
        for mode in modes[k % len(modes) :] + modes[: k % len(modes)]:  # each mode first as often as the others
            if mode is None:
                out[mode] = decode(gen, ids, n)
            else:
                out[mode] = decode(
                    gen, ids, n, early_exit=mode, draft_tokens=draft_tokens, draft_confidence=draft_confidence
                )
        plain = out[None]
        plain_texts.append(gen.tokenizer.decode(plain.ids))
        totals["greedy"]["tokens"] += len(plain.ids)
        totals["greedy"]["seconds"] += plain.seconds
        for e in exits:
            spec = out[e]
            t = totals[str(e)]
            t["tokens"] += len(spec.ids)
            t["seconds"] += spec.seconds
            t["identical_prompts"] += spec.ids == plain.ids
            t["drafted"] += spec.drafted or 0
            t["accepted"] += spec.accepted or 0
    for t in totals.values():
        t["tokens_per_s"] = t["tokens"] / t["seconds"] if t["seconds"] > 0 else 0.0
    base = totals.pop("greedy")
    for t in totals.values():
        t["speedup"] = t["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] > 0 else None
        t["identical"] = t["identical_prompts"] == len(prompts)
        t["acceptance"] = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
    identical = [e for e in exits if totals[str(e)]["identical"]]
    best = max(identical, key=lambda e: totals[str(e)]["tokens_per_s"]) if identical else None
    return {
        "model": gen.label,
        **{k: gen.info[k] for k in ("hf_class", "device", "dtype") if k in gen.info},
        "layers": gen.num_layers,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "draft_tokens": draft_tokens,
        "draft_confidence": draft_confidence,
        "greedy": base,
        "exits": totals,
        "best_exit": best,
        "best_speedup": totals[str(best)]["speedup"] if best is not None else None,
        "_plain_texts": plain_texts,
    }


def through_cli(source: str, prompts: list[str], expected: list[str], early_exit: int, **opts: Any) -> dict[str, Any]:
    """``./launch.sh generate SOURCE --prompt P --early-exit E --json`` for each prompt (a subprocess, as a user runs
    it): whether both its continuations equal ``expected`` (the in-process plain greedy ones), tokens/s, acceptance."""
    rows = []
    for prompt, want in zip(prompts, expected):
        args = [sys.executable, "-m", "pretrain", "generate", source, "--prompt", prompt, "--json"]
        args += ["--early-exit", str(early_exit)]
        args += [f"--{k.replace('_', '-')}={v}" for k, v in opts.items() if v is not None]
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"./launch.sh generate exited {proc.returncode}: {last}")
        r = json.loads(proc.stdout)
        e = r["early_exit"]
        rows.append(
            {
                "same_as_in_process": r["continuation"] == want and e["continuation"] == want,
                "identical": e["identical"],
                "tokens_per_s": r["tokens_per_s"],
                "early_exit_tokens_per_s": e["tokens_per_s"],
                "acceptance": e["acceptance"],
            }
        )
    return {
        "prompts": len(rows),
        "early_exit": early_exit,
        "identical": all(r["identical"] for r in rows),
        "same_as_in_process": all(r["same_as_in_process"] for r in rows),
        "runs": rows,
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"self-speculative decoding: {r['model']} ({r.get('hf_class')}, {r['layers']} layers, {r.get('device')})")
    print(f"  {r['prompts']} held-out prompts, up to {r['max_new_tokens']} new tokens each, greedy")
    print(f"  {'mode':<16}{'tokens/s':>10}{'speedup':>9}{'identical':>11}{'acceptance':>12}")
    print(f"  {'plain greedy':<16}{r['greedy']['tokens_per_s']:>10.1f}{'1.00x':>9}{'':>11}{'':>12}")
    for e, t in r["exits"].items():
        same = f"{t['identical_prompts']}/{r['prompts']}"
        print(f"  {'exit ' + e:<16}{t['tokens_per_s']:>10.1f}{t['speedup']:>8.2f}x{same:>11}{t['acceptance']:>12.3f}")
    print(f"  best exit: {r['best_exit']}" + (f" ({r['best_speedup']:.2f}x)" if r["best_exit"] is not None else ""))
    if "cli" in r:
        c = r["cli"]
        print(
            f"  ./launch.sh generate --early-exit {c['early_exit']} on {c['prompts']} prompts: identical to plain "
            f"greedy {c['identical']}, same as in-process {c['same_as_in_process']}"
        )


def parse_args(argv: list[str]):
    """``bench --early-exit``'s arguments (the benchmark of one model and the study share them), checked."""
    from pretrain.config.errors import ArgumentParser

    p = ArgumentParser(prog="launch.sh bench --early-exit", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--early-exit", action="store_true", help="this benchmark")
    p.add_argument("--model", default=None, help="run id, run or checkpoint dir, or Hugging Face dir (none: the study)")
    p.add_argument("--exits", default="", help="comma-separated exits E (default: every E below the depth)")
    p.add_argument("--prompts", type=int, default=50, help="held-out prompts (default 50)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="tokens per prompt (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    p.add_argument(
        "--draft-tokens", type=int, default=None, help="tokens per draft (default: transformers'; the study: 4)"
    )
    p.add_argument(
        "--draft-confidence",
        type=float,
        default=None,
        help="stop drafts below this probability (default: transformers')",
    )
    p.add_argument("--cli-prompts", type=int, default=3, help="prompts also run through ./launch.sh generate")
    p.add_argument("--data", nargs="+", action="extend", default=[], metavar="PATH", help="prompts from these files")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tokens", type=int, default=0, help="the study: baseline training tokens (default 80/param)")
    p.add_argument("--seed", type=int, default=0, help="the study: train.seed of both runs (default 0)")
    p.add_argument("--study-dir", default=None, help="the study: where its runs and MLflow store go (.cache/)")
    p.add_argument(
        "--reuse",
        default="",
        help="the study: earlier studies' directories or mlflow.db files (comma-separated) whose run of the same "
        "config is read instead of trained (the baseline is the growth study's scratch run; benchmarks/reuse.py)",
    )
    p.add_argument(
        "--jobs",
        default=None,
        help="the study: 1, 2 or auto (default): 2 trains its two runs side by side, each in its own process on its "
        "share of the CPUs; auto does so on a machine without a GPU and with 2 CPUs or more (side_by_side.py)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="the study: config overrides of both runs")
    a = p.parse_args(argv)
    if a.prompts < 1 or a.prompt_tokens < 1 or a.cli_prompts < 0:
        raise ConfigError("bench --early-exit: --prompts and --prompt-tokens must be >= 1, --cli-prompts >= 0")
    return a


def run(a) -> int:
    """``bench --early-exit --model M``: the benchmark of one model (``a`` from :func:`parse_args`)."""
    from eval.generator import load_generator

    if a.overrides:
        raise ConfigError(f"bench --early-exit --model: key=value overrides are for the study only ({a.overrides[0]})")
    if a.reuse or a.jobs is not None:
        raise ConfigError(f"bench --early-exit --model: {'--reuse' if a.reuse else '--jobs'} is for the study only")
    try:
        exits = [int(x) for x in a.exits.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"bench --early-exit --exits: {a.exits!r} is not a comma-separated list of layers") from None
    gen = load_generator(a.model, device=a.device)
    exits = exits or list(range(1, gen.num_layers))
    prompts = heldout_prompts(gen, a.prompts, a.prompt_tokens, a.data)
    result = decoding_benchmark(
        gen,
        prompts,
        exits,
        max_new_tokens=a.max_new_tokens,
        draft_tokens=a.draft_tokens,
        draft_confidence=a.draft_confidence,
    )
    plain_texts = result.pop("_plain_texts")
    if a.cli_prompts and result["best_exit"] is not None:
        k = min(a.cli_prompts, len(prompts))
        result["cli"] = through_cli(
            a.model,
            prompts[:k],
            plain_texts[:k],
            result["best_exit"],
            max_new_tokens=a.max_new_tokens,
            draft_tokens=a.draft_tokens,
            draft_confidence=a.draft_confidence,
            device=a.device,
        )
    if a.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print_table(result)
    return 0
