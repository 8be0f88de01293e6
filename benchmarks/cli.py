"""``./launch.sh bench [MODE]``: parses the arguments and runs the benchmark a mode asks for, then prints its
result (a table, or one JSON object on stdout with ``--json``; everything else goes to stderr).

=====================  ======================================================================================
mode                   benchmark
=====================  ======================================================================================
(none)                 the step against a bare PyTorch step, MFU, data throughput, the real loop and its start-up,
                       MoE against dense (:mod:`benchmarks.step`, :mod:`benchmarks.loop`, :mod:`benchmarks.moe`)
``--layer-drop``       also the step at layer-drop rates 0, 0.25, 0.5 (:mod:`benchmarks.layer_drop`); with
                       ``--quality`` only the layer-dropout study (:mod:`benchmarks.layer_drop_quality`)
``--vs-hf``            ``./launch.sh train`` against Hugging Face Trainer (:mod:`benchmarks.vs_hf`)
``--growth``           the growth study: scratch, growth recipes and their small models alone at equal FLOPs
                       (:mod:`benchmarks.growth`)
``--recompute``        activation recomputation: memory and time (:mod:`benchmarks.recompute`)
``--parallel``         sequence and tensor parallelism: speed, memory, communication (:mod:`benchmarks.parallel`)
``--checkpoint``       checkpoint cost as the model grows (:mod:`benchmarks.checkpoint`)
``--data``             token shards: tokenize throughput with 1 and 2 Ray workers, shard vs text loader tokens/s
                       (:mod:`benchmarks.token_shards`)
``--cluster``          submit-to-first-step latency on the local head (:mod:`benchmarks.cluster_jobs`)
``--build-corpus``     the studies' corpus: the installed packages' Python sources and docs, deduplicated, split,
                       counted, cached (:mod:`benchmarks.corpus`)
``--early-exit``       self-speculative against plain greedy decoding of one model: tokens/s per exit, identical
                       outputs, acceptance rate, also via generate (:mod:`benchmarks.early_exit_decoding`)
``--gpu``              the one GPU check: training, MFU, SDPA kernel, memory plan, checkpoint, ZeRO-3, MoE, growth,
                       export, each pass/fail with its figure (:mod:`benchmarks.gpu_check`; tiny without CUDA)
=====================  ======================================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

import torch

from benchmarks.growth_check import GOAL_SAVING
from benchmarks.loop import loop_benchmark
from benchmarks.step import ROOT, run_bench, run_moe_bench, step_after_loop
from pretrain.config import load_config
from pretrain.config.errors import ArgumentParser
from pretrain.invocation import command
from pretrain.train.callbacks.speed import LOOP_WARMUP_STEPS


def bench(argv: list[str]) -> int:
    """The ``bench`` command: ``--cluster``, ``--checkpoint``, ``--data``, ``--gpu``, ``--build-corpus`` and
    ``--early-exit`` have arguments of their own; every other mode is parsed by :func:`main`."""
    from cluster.requires import require_ray

    if "--cluster" in argv:  # submit-to-first-step latency and checkpoint share on the local head
        from benchmarks.cluster_jobs import main as cluster_bench

        if not {"-h", "--help"} & set(argv):
            require_ray(f"{command()} bench --cluster")
        return cluster_bench(argv)
    if "--gpu" in argv:  # the one GPU check: real train/resume/export runs, tiny without CUDA
        from benchmarks.gpu_check import main as gpu_check

        return gpu_check(argv)
    if "--build-corpus" in argv:  # the studies' corpus: the installed packages' sources and docs, cached
        from benchmarks.corpus import main as build_corpus

        return build_corpus(argv)
    if "--early-exit" in argv:  # self-speculative decoding of one model (--model), or the early-exit study
        from benchmarks.early_exit_study import main as early_exit_bench

        return early_exit_bench(argv)
    if "--data" in argv:  # token shards: tokenize throughput (Ray Data, 1 and 2 workers), shard vs text loader
        from benchmarks.token_shards import main as data_bench

        if not {"-h", "--help"} & set(argv):
            require_ray(f"{command()} bench --data", "it tokenizes with Ray Data; ")
        return data_bench(argv)
    if "--checkpoint" in argv:  # checkpoint cost as the model grows: real train/resume runs per size
        from benchmarks.checkpoint import main as checkpoint_bench

        return checkpoint_bench(argv)
    return main(argv)


def modes_help() -> str:
    """The mode table of this module's docstring as plain text (the epilog of ``bench --help``)."""
    lines = (__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    width = lines[rules[0]].index(" ") + 2  # the first column, as the table's rule draws it
    out = []
    for line in lines[rules[1] + 1 : rules[2]]:
        mode, text = (re.sub(r":mod:`([^`]*)`", r"\1", part).replace("``", "") for part in (line[:width], line[width:]))
        out.append(f"  {mode.rstrip():<{width}}{text}")
    own = "--cluster, --checkpoint, --data, --gpu, --build-corpus, --early-exit"
    head = f"modes ({own} have options of their own: bench --gpu --help):"
    return head + "\n" + "\n".join(out)


def main(argv: list[str]) -> int:
    p = ArgumentParser(
        prog="launch.sh bench", epilog=modes_help(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (on stdout; all else on stderr)")
    p.add_argument("--steps", type=int, default=0, help="steps per timed round (default: 8 CPU, 20 GPU)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-moe", action="store_true", help="skip the MoE part (MoE vs dense, all-to-all share)")
    p.add_argument("--no-loop", action="store_true", help="skip the real training loop (python -m pretrain train)")
    p.add_argument(
        "--loop-steps",
        type=int,
        default=0,
        help=f"steps of the real training loop, default 40 (60 with --vs-hf); the first {LOOP_WARMUP_STEPS} "
        "are left out of the loop's tokens/s",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="workers of the real training loop (the step benchmark stays one process; "
        "loop_vs_own_step_ratio compares the loop with its own steps)",
    )
    p.add_argument(
        "--vs-hf",
        action="store_true",
        help="only the comparison with Hugging Face Trainer: ./launch.sh train and Trainer on the same "
        "model, tokenizer, token stream, batch, steps, fp32 and threads (benchmarks/vs_hf.py)",
    )
    p.add_argument(
        "--corpus",
        default=None,
        help="--vs-hf: the text corpus (default: ../shared/corpora/wikitext2-valid.txt when present, "
        "else the built-in demo corpus)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="--vs-hf: runs of ours, alternating with N + 1 of Trainer; each side is the mean of its runs",
    )
    p.add_argument(
        "--growth",
        action="store_true",
        help="only the growth study: scratch vs growth recipes vs their small models alone at equal FLOPs, per "
        "seed (benchmarks/growth.py; on the installed packages' sources, built once: --build-corpus)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="--growth, --layer-drop --quality: the budget in target-model tokens (default: 80 per target parameter; "
        "--gpu-size: 20)",
    )
    p.add_argument(
        "--scan",
        action="store_true",
        help="--growth: only the iso-FLOP scan: the target from scratch and the recipes' small models alone on the "
        "budget (where the target overtakes them), no growth",
    )
    p.add_argument(
        "--gpu-size",
        action="store_true",
        help="--growth: the study at a GPU's size (benchmarks/growth.py GPU_PRESET; key=value overrides still win)",
    )
    p.add_argument(
        "--study-dir",
        default=None,
        help="--growth, --layer-drop --quality: where the study's runs and MLflow store go (default .cache/ here)",
    )
    p.add_argument(
        "--reuse",
        default="",
        help="--growth, --layer-drop --quality: earlier studies' directories or mlflow.db files (comma-separated); "
        "a run whose config matches a finished run there is read from it instead of trained (CPU runs are "
        "deterministic; the code and library versions are yours to keep equal; benchmarks/reuse.py)",
    )
    p.add_argument(
        "--jobs",
        default="auto",
        help="--growth: runs trained side by side, each in its own process on its share of the CPUs (auto: one "
        "per CPU on a machine without a GPU, else 1; benchmarks/side_by_side.py)",
    )
    p.add_argument("--seeds", default="0,1", help="--growth, --layer-drop --quality: the seeds (comma-separated)")
    p.add_argument(
        "--recipes",
        default="",
        help="--growth: these recipes (comma-separated; default: stack4@10%%, G_stack; benchmarks/growth.py)",
    )
    p.add_argument(
        "--check-saving",
        type=float,
        default=None,
        metavar="SHARE",
        help=f"--growth: also train each recipe on (1 - SHARE) of the budget (the goal: {GOAL_SAVING}), its schedule "
        "fully decayed there, and report whether it reaches the scratch run's final loss (benchmarks/growth_check.py)",
    )
    p.add_argument(
        "--sizes",
        choices=("auto", "yes", "no"),
        default="no",
        help="--growth: the trend over three target sizes at the same tokens (auto: when the best recipe saves "
        "< 25 %%; default no)",
    )
    p.add_argument(
        "--layer-drop", action="store_true", help="also time the step at layer-drop rates 0, 0.25, 0.5 (layer mode)"
    )
    p.add_argument(
        "--quality",
        action="store_true",
        help="with --layer-drop: only the layer-dropout study in the growth study's regime (whether depth pays, "
        "progressive layer dropping's time to loss, pruning against a half-depth model from scratch; five runs per "
        "seed; benchmarks/layer_drop_quality.py)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="only activation recomputation: peak memory and step time of none, full, selective on the "
        "config's model and a larger one (benchmarks/recompute.py)",
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="only sequence/tensor parallelism: 1 worker vs 2 (parallel.sequence=2, parallel.tensor=2) on the demo "
        "decoder at --seq-len tokens (benchmarks/parallel.py)",
    )
    p.add_argument("--seq-len", type=int, default=2048, help="--parallel: the sequence length (default 2048)")
    p.add_argument("rest", nargs="*", help="CONFIG.yaml and key=value overrides")
    a = p.parse_args(argv)
    result_out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # library chatter (e.g. DeepSpeed's op-build line) is no result
        result = measure(a)
    if a.json:
        print(json.dumps(result, indent=1), file=result_out)
    elif a.vs_hf:
        from benchmarks.vs_hf import format_table

        print(format_table(result), file=result_out)
    else:
        for k, v in result.items():
            if isinstance(v, dict):
                v = (
                    "{"
                    + ", ".join(f"{kk}: {vv:,.4g}" if isinstance(vv, float) else f"{kk}: {vv}" for kk, vv in v.items())
                    + "}"
                )
            print(f"{k:<34} {v:,.4g}" if isinstance(v, float) else f"{k:<34} {v}", file=result_out)
    result_out.flush()
    return 0


def measure(a: argparse.Namespace) -> dict:
    """Everything ``main``'s arguments ask for, as one flat dict."""
    gpu = torch.cuda.is_available()
    if a.growth:
        from benchmarks.growth import GPU_PRESET, GPU_TOKENS_PER_PARAM, TOKENS_PER_PARAM, growth_bench, summary
        from benchmarks.side_by_side import jobs_of

        return summary(
            growth_bench(
                [*(GPU_PRESET if a.gpu_size else []), *(r for r in a.rest if "=" in r)],
                tokens=a.tokens or None,
                seeds=tuple(int(x) for x in a.seeds.split(",")),
                only=a.recipes.split(",") if a.recipes else None,
                sizes={"auto": None, "yes": True, "no": False}[a.sizes],
                scan=a.scan,
                root=Path(a.study_dir) if a.study_dir else None,
                reuse=tuple(Path(x) for x in a.reuse.split(",") if x),
                tokens_per_param=GPU_TOKENS_PER_PARAM if a.gpu_size else TOKENS_PER_PARAM,
                jobs=jobs_of(a.jobs, gpu),
                check=a.check_saving,
            )
        )
    if a.layer_drop and a.quality:
        from benchmarks.layer_drop_quality import study

        return study(
            [r for r in a.rest if "=" in r],
            tokens=a.tokens or None,
            seeds=tuple(int(x) for x in a.seeds.split(",")),
            root=Path(a.study_dir) if a.study_dir else None,
            reuse=tuple(Path(x) for x in a.reuse.split(",") if x),
        )
    if a.parallel:
        from benchmarks.parallel import parallel_bench

        path = next((r for r in a.rest if "=" not in r), ROOT / "configs" / "demo-decoder.yaml")
        return parallel_bench(str(path), [r for r in a.rest if "=" in r], a.seq_len, a.steps or 4)
    if a.recompute:
        from benchmarks.recompute import recompute_bench

        path = next((r for r in a.rest if "=" not in r), ROOT / "configs" / "demo-decoder.yaml")
        return recompute_bench(path, [r for r in a.rest if "=" in r], a.steps or 4, min(a.rounds, 3))
    path = next((r for r in a.rest if "=" not in r), None)
    overrides = [r for r in a.rest if "=" in r]
    if a.vs_hf:
        from benchmarks.vs_hf import vs_hf_bench

        return vs_hf_bench(
            path or ROOT / "configs" / "demo-decoder.yaml",
            overrides,
            corpus=a.corpus,
            steps=a.loop_steps or 60,
            repeats=a.repeats,
        )
    if path is None:
        path = ROOT / "configs" / ("gpt-125m.yaml" if gpu else "demo-decoder.yaml")
        if gpu:  # benchmark one GPU: same model, one worker's micro-batch
            overrides = [
                "cluster.num_workers=1",
                "train.global_batch_size=16",
                "train.micro_batch_size=16",
                "train.precision=bf16",
                "model.vocab_size=50304",
                "data.sources=[{path: demo}]",
                "data.num_streams=8",
                "data.tokenizer_vocab_size=8192",
                *overrides,
            ]
    cfg = load_config(path, overrides)
    global_batch = cfg.train.global_batch_size
    # One worker, no accumulation: each timed call is exactly one optimizer step on both sides.
    cfg.train.global_batch_size = cfg.train.micro_batch_size
    cfg.data.num_streams = 1
    cfg.parallel.expert = 1  # all experts on the one worker (the MoE part measures expert parallelism separately)
    steps = a.steps or (20 if gpu else 8)
    result = run_bench(cfg, steps, a.rounds)
    if not a.no_loop:  # the loop a user runs, on the same model, batch and threads as the step just timed
        result.update(
            loop_benchmark(
                str(path),
                overrides,
                step_tokens_per_s=result["tokens_per_s"],
                steps=a.loop_steps or 40,
                threads=torch.get_num_threads(),
                micro_batch=cfg.train.micro_batch_size,
                global_batch=global_batch,
                workers=a.workers,
            )
        )
        result.update(step_after_loop(cfg, torch.device("cuda" if gpu else "cpu"), result, steps, a.rounds))
    if not a.no_moe:
        result.update(run_moe_bench(cfg, overrides, steps, a.rounds, gpu))
    if a.layer_drop:
        from benchmarks.layer_drop import layer_drop_bench

        result.update(layer_drop_bench(cfg, torch.device("cuda" if gpu else "cpu"), steps, a.rounds))
    return result
