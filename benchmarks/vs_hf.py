"""Our ``./launch.sh train`` against Hugging Face Trainer, as a user would compare them
(``./launch.sh bench --vs-hf [--repeats N] [--corpus PATH] [--loop-steps N] [--json] [CONFIG] [key=value ...]``).

Both sides get the same:

* model: the config's decoder (default ``configs/demo-decoder.yaml``: 4 layers x 256, GQA, seq 128), on the HF side
  as the standard class our export maps it to (``LlamaForCausalLM`` for the demo), **initialised with the same
  weights** (our seeded init, converted by :func:`pretrain.export.hf.to_hf_model`);
* tokenizer: trained once by the bench on the corpus (our BPE, ``data.tokenizer_vocab_size``) before either command
  starts, and given to both (``data.tokenizer=DIR`` for ours); neither wall time includes training it;
* token stream: the packed sequences of our data pipeline for this config (``TrainBatches``, one worker), in
  training order; Trainer reads them from a tensor file (no tokenisation in its wall time), ours packs them itself;
* corpus: ``--corpus`` (default: the WikiText-2 validation text in ``../shared/corpora`` when present, else the
  built-in demo corpus, as the tests choose);
* batch (``train.micro_batch_size`` = global batch, one worker), steps (default 60), fp32, threads (default 2, both
  ``train.num_threads`` and Trainer's ``torch.set_num_threads``), AdamW hyper-parameters, warm-up + cosine to
  ``min_lr_ratio``, gradient clipping and logging interval.

Trainer runs before and after ours (a machine's speed can drift by several percent over minutes: thermal limits,
other load), and its side is the mean of its runs (``hf.runs`` has each). ``--repeats N``
alternates N runs of ours with N + 1 of Trainer (each side the mean of its runs; ``paired_*_ratios``: each run of
ours over the Trainer runs just before and after it), for an answer that one drifting run cannot swing.

Measured: each command's whole wall time as a subprocess (ours: ``./launch.sh train`` as a user runs it — one worker, so
in the command's own process unless ``cluster.ray_for_one_worker=true`` is given, which runs it through an embedded Ray
— with its MLflow run, final validation and checkpoint; HF: ``python -m benchmarks.hf_trainer``, which also saves its
model), and each one's steady-state tokens/s from the end times of its steps, the first ``LOOP_WARMUP_STEPS`` left out
on both sides (mean over the rest; also the best window of ``loop_window`` steps). Targets (``TOKENS_PER_S_TARGET``,
``WALL_TARGET``): tokens/s ours/HF >= 1.0, wall time ours/HF <= 1.2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.loop import run_training
from pretrain.config import ConfigError, RunConfig, load_config, make_plan
from pretrain.train.callbacks.speed import LOOP_WARMUP_STEPS, cycle, loop_rates

ROOT = Path(__file__).resolve().parents[1]
SHARED_CORPUS = ROOT.parent / "shared" / "corpora" / "wikitext2-valid.txt"
TOKENS_PER_S_TARGET, WALL_TARGET = 1.0, 1.2


def default_corpus() -> str:
    """The WikiText-2 validation text beside the project when present, else the built-in demo corpus."""
    return str(SHARED_CORPUS) if SHARED_CORPUS.is_file() else "demo"


def comparison_overrides(corpus: str, steps: int, batch: int, threads: int) -> list[str]:
    """What the comparison fixes on the config (the user's overrides come after and win)."""
    source = corpus if corpus == "demo" else str(Path(corpus).expanduser().resolve())
    return [
        f"data.sources=[{{path: '{source}'}}]",
        f"train.max_steps={steps}",
        f"train.global_batch_size={batch}",
        f"train.micro_batch_size={batch}",
        "train.precision=fp32",
        f"train.num_threads={threads}",
        "cluster.num_workers=1",
        "stability.plot_at_end=false",
    ]


def comparison_config(config: str | Path, overrides: list[str]) -> RunConfig:
    cfg = load_config(config, overrides)
    if cfg.model.kind != "decoder" or cfg.moe.enabled:
        raise ConfigError(
            "bench --vs-hf: compares a dense decoder (a causal LM for Trainer); "
            f"{cfg.name} is {'an MoE' if cfg.moe.enabled else 'an encoder'}"
        )
    if cfg.cluster.num_workers != 1:
        raise ConfigError("bench --vs-hf: compares one worker with one Trainer process (cluster.num_workers=1)")
    return cfg


def resolve_vocab(cfg: RunConfig, tokenizer) -> None:
    """``model.vocab_size`` as run preparation sets it (0: the tokenizer's size rounded up to the multiple)."""
    if cfg.model.vocab_size == 0:
        m = cfg.model.vocab_multiple
        cfg.model.vocab_size = -(-len(tokenizer) // m) * m


def build_pair(cfg: RunConfig, tokenizer):
    """(our model, the HF model of the same architecture and the same initial weights)."""
    from pretrain.export.hf import export_target, special_token_ids, to_hf_model
    from pretrain.model import build_model

    cls, why = export_target(cfg.model, cfg.moe)
    if cls is None:
        raise ConfigError(f"bench --vs-hf: {cfg.name} has no standard Hugging Face class to train with Trainer: {why}")
    ours = build_model(cfg.model, cfg.train.seed, cfg.moe)
    hf = to_hf_model(cfg.model, ours.state_dict(), special_token_ids(tokenizer, cfg.model.kind))
    return ours, hf


def token_stream(cfg: RunConfig, tokenizer, steps: int) -> torch.Tensor:
    """The sequences our run trains on in its first ``steps`` steps, in order: ``[steps * batch, seq_len]``."""
    from pretrain.data import TrainBatches

    plan = make_plan(cfg, 1)
    batches = TrainBatches(cfg.data, kind=cfg.model.kind, tokenizer=tokenizer, plan=plan, rank=0, seed=cfg.train.seed)
    return torch.cat([batches.next_step()["input_ids"] for _ in range(steps)])


def _env() -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + pp if pp else ""), "HF_HUB_OFFLINE": "1"}


def run_hf(cfg: RunConfig, model_dir: Path, tokens: Path, out: Path, steps: int, threads: int) -> dict:
    """``python -m benchmarks.hf_trainer`` as a subprocess: its wall time and steady-state tokens/s."""
    t = cfg.train
    report = out / "hf_report.json"
    args = [
        sys.executable,
        "-m",
        "benchmarks.hf_trainer",
        str(model_dir),
        str(tokens),
        str(out / "hf-out"),
        f"--steps={steps}",
        f"--batch={t.micro_batch_size}",
        f"--threads={threads}",
        f"--lr={t.lr}",
        f"--min-lr-ratio={t.min_lr_ratio}",
        f"--warmup={t.warmup_steps}",
        f"--weight-decay={t.weight_decay}",
        "--betas",
        str(t.beta1),
        str(t.beta2),
        f"--eps={t.eps}",
        f"--grad-clip={t.grad_clip}",
        f"--log-every={t.log_every}",
        f"--seed={t.seed}",
        f"--json-out={report}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not report.is_file():
        raise RuntimeError(
            f"bench --vs-hf: the Trainer run failed (exit {proc.returncode}):\n" + (proc.stdout + proc.stderr)[-3000:]
        )
    rep = json.loads(report.read_text())
    window = cycle(t.log_every, cfg.stability.health_every)
    mean, best, timed = loop_rates(rep["step_ends"], t.micro_batch_size * cfg.model.max_seq_len, window)
    return {
        "wall_s": wall,
        "tokens_per_s": mean,
        "best_window_tokens_per_s": best,
        "steps_timed": timed,
        "threads": rep["threads"],
        "steps": rep["steps"],
        "final_loss": rep["losses"][-1] if rep["losses"] else None,
    }


SIDE_KEYS = ("wall_s", "tokens_per_s", "best_window_tokens_per_s")


def mean_side(runs: list[dict], keys: tuple[str, ...] = SIDE_KEYS) -> dict:
    """One side as the mean of its runs in ``keys`` (tokens/s, wall time), with each run's ``keys`` in ``runs``."""
    keys = tuple(k for k in keys if all(isinstance(r.get(k), (int, float)) for r in runs))
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in keys}
    return {**runs[0], **mean, "runs": [{k: r[k] for k in mean} for r in runs]}


def paired_ratios(ours: list[dict], hf: list[dict], key: str) -> list[float]:
    """Each run of ours over the mean of the Trainer runs just before and after it (``hf`` alternates with
    ``ours``: one more run, first and last), so drift over minutes hits both sides of every pair alike."""
    return [o[key] / ((before[key] + after[key]) / 2) for o, before, after in zip(ours, hf, hf[1:])]


def run_ours(config: str, overrides: list[str], tokenizer_dir: Path) -> dict:
    """``./launch.sh train`` as a subprocess (MLflow in a temporary store): wall time and loop speed."""
    s = run_training(
        config, [*overrides, f"data.tokenizer={tokenizer_dir}"], command=[str(ROOT / "launch.sh"), "train"]
    )
    return {
        "wall_s": s["command_wall_s"],
        "tokens_per_s": float(s.get("loop_mean_tokens_per_s", 0.0)),
        "best_window_tokens_per_s": float(s.get("loop_tokens_per_s", 0.0)),
        "steps_timed": s.get("loop_steps_timed", 0),
        "threads": s.get("torch_threads"),
        "steps": s.get("step"),
        "final_loss": s.get("final_train_loss"),
        "time_to_first_step_s": s.get("time_to_first_step_s"),
        "step_tokens_per_s": float(s.get("tokens_per_s", 0.0)),
    }


def vs_hf_bench(
    config: str | Path,
    user_overrides: list[str],
    *,
    corpus: str | None = None,
    steps: int = 60,
    batch: int = 16,
    threads: int = 2,
    repeats: int = 1,
) -> dict:
    """Both commands on the same model, tokenizer, token stream, batch, steps, precision and threads; ours
    ``repeats`` times, Trainer before the first and after each (alternating), each side the mean of its runs."""
    if repeats < 1:
        raise ConfigError(f"bench --vs-hf: --repeats must be at least 1, not {repeats}")
    import importlib.util

    from pretrain.data import load_or_train_tokenizer

    corpus = corpus or default_corpus()
    if corpus != "demo" and not Path(corpus).expanduser().exists():
        raise ConfigError(f"bench --vs-hf: --corpus {corpus} does not exist")
    if importlib.util.find_spec("accelerate") is None:  # Trainer's own error would come after the tokenizer
        raise ConfigError(
            "bench --vs-hf: Hugging Face Trainer needs accelerate (in requirements.lock): ./launch.sh setup"
        )
    overrides = [*comparison_overrides(corpus, steps, batch, threads), *user_overrides]
    cfg = comparison_config(config, overrides)
    with tempfile.TemporaryDirectory(prefix="pretrain-bench-vs-hf-") as tmp:
        tmp_dir = Path(tmp)
        print(f"[bench] training the shared tokenizer on {corpus} ...", file=sys.stderr)
        tokenizer = load_or_train_tokenizer(cfg.data, out_dir=tmp_dir / "bench-tokenizer")
        resolve_vocab(cfg, tokenizer)
        _, hf = build_pair(cfg, tokenizer)
        hf.save_pretrained(str(tmp_dir / "hf-init"))
        torch.save(token_stream(cfg, tokenizer, steps), tmp_dir / "tokens.pt")

        def trainer(when: str) -> dict:  # before and after ours: a machine's speed drifts over minutes
            print(
                f"[bench] Hugging Face Trainer ({type(hf).__name__}), {steps} steps, {when} ours ...", file=sys.stderr
            )
            (tmp_dir / when).mkdir()
            return run_hf(cfg, tmp_dir / "hf-init", tmp_dir / "tokens.pt", tmp_dir / when, steps, threads)

        hf_runs, our_runs = [trainer("before")], []
        for i in range(repeats):
            print(f"[bench] ./launch.sh train, {steps} steps ({i + 1}/{repeats}) ...", file=sys.stderr)
            our_runs.append(run_ours(str(config), overrides, tmp_dir / "bench-tokenizer"))
            hf_runs.append(trainer("after" if i == 0 else f"after-{i + 1}"))
    hf_side = mean_side(hf_runs)
    ours = mean_side(our_runs, (*SIDE_KEYS, "time_to_first_step_s", "step_tokens_per_s"))
    ratio = ours["tokens_per_s"] / hf_side["tokens_per_s"] if hf_side["tokens_per_s"] else None
    wall_ratio = ours["wall_s"] / hf_side["wall_s"] if hf_side["wall_s"] else None
    return {
        "config": cfg.name,
        "hf_class": type(hf).__name__,
        "corpus": corpus,
        "steps": steps,
        "batch": batch,
        "seq_len": cfg.model.max_seq_len,
        "threads": threads,
        "precision": "fp32",
        "warmup_steps_excluded": LOOP_WARMUP_STEPS,
        "hf": hf_side,
        "ours": ours,
        "tokens_per_s_ratio": ratio,
        "tokens_per_s_target": TOKENS_PER_S_TARGET,
        "wall_ratio": wall_ratio,
        "wall_target": WALL_TARGET,
        "repeats": repeats,
        "paired_tokens_per_s_ratios": paired_ratios(our_runs, hf_runs, "tokens_per_s"),
        "paired_wall_ratios": paired_ratios(our_runs, hf_runs, "wall_s"),
        "meets_targets": bool(ratio and wall_ratio and ratio >= TOKENS_PER_S_TARGET and wall_ratio <= WALL_TARGET),
    }


def format_table(r: dict) -> str:
    """The comparison as a table (what ``--json`` prints as one object)."""
    hf, ours = r["hf"], r["ours"]

    def row(name: str, key: str, fmt: str, ratio: float | None = None, target: str = "") -> str:
        a, b = hf.get(key), ours.get(key)
        cell = lambda v: format(v, fmt) if isinstance(v, (int, float)) else "-"  # noqa: E731
        rt = f"{ratio:.2f}" if ratio is not None else "-"
        return f"{name:<34} {cell(a):>12} {cell(b):>12} {rt:>8}  {target}"

    lines = [
        f"{r['config']} ({r['hf_class']} on the HF side), corpus {r['corpus']}: {r['steps']} steps x batch "
        f"{r['batch']} x seq {r['seq_len']}, {r['precision']}, {r['threads']} threads each",
        f"{'':<34} {'HF Trainer':>12} {'ours':>12} {'ours/HF':>8}",
        row(
            f"steady-state tokens/s (first {r['warmup_steps_excluded']} out)",
            "tokens_per_s",
            ",.0f",
            r["tokens_per_s_ratio"],
            f"target >= {r['tokens_per_s_target']}",
        ),
        row(
            "best-window tokens/s",
            "best_window_tokens_per_s",
            ",.0f",
            _ratio(ours.get("best_window_tokens_per_s"), hf.get("best_window_tokens_per_s")),
        ),
        row("whole-command wall time (s)", "wall_s", ".1f", r["wall_ratio"], f"target <= {r['wall_target']}"),
        row("time to first step (s)", "time_to_first_step_s", ".1f"),
        row("steps timed", "steps_timed", "d"),
        row("torch threads", "threads", "d"),
        row("final train loss (HF: last log's mean)", "final_loss", ".3f"),
    ]
    if r.get("repeats", 1) > 1:
        fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        lines += [
            f"runs: ours {r['repeats']}, Trainer {r['repeats'] + 1} (alternating); each side is the mean of its runs",
            f"each run of ours over the Trainer runs around it: tokens/s {fmt(r['paired_tokens_per_s_ratios'])}; "
            f"wall {fmt(r['paired_wall_ratios'])}",
        ]
    lines.append(f"meets both targets: {'yes' if r['meets_targets'] else 'no'}")
    return "\n".join(lines)


def _ratio(a, b) -> float | None:
    return a / b if a and b else None
