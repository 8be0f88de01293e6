"""What a checkpoint costs as the model grows (``./launch.sh bench --checkpoint``): for each hidden size (8 layers,
2 workers, ZeRO-2 by default) real training runs as a user starts them (``python -m pretrain train``/``resume``,
through Ray; with ``cluster.use_ray=false`` as ``torchrun`` ranks), each in a temporary MLflow store and checkpoint
root under ``--dir`` (the filesystem measured, removed afterwards):

1. a synchronous run (``checkpoint.async=false`` when the key exists): a save every ``--every`` steps, ``--saves``
   of them before the last step (which saves too); its summary gives the bytes per checkpoint, the loop stall of
   each save (the whole save when it is synchronous) and every rank's hash seconds per save;
2. the raw write limit of the same bytes on the same filesystem, right after: one sequential write + fsync
   (:func:`raw_write_seconds`), against which the synchronous save is put (``sync_save_vs_raw``);
3. ``resume RUN_ID`` of that run for one step: seconds from the command to its first step and the bytes each
   rank hashed before it (``resume_hashes_each_byte_once``: they add up to the checkpoint's bytes);
4. the same run with ``checkpoint.async=true``: its loop stall per save (the copy to host memory, the commit at
   a later step boundary, any wait for the previous save), its parts and the largest host snapshot of a rank.
   Without the ``checkpoint.async`` key it is reported unavailable.

Stalls are those of the saves before the last step (a run's final save is waited for at its end either way).

    ./launch.sh bench --checkpoint [--json] [--sizes 256,512,1024] [--every N] [--saves N] [--dir PATH]
                                   [CONFIG] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from pretrain.checkpoint.layout import SUMMARY
from pretrain.config import ConfigError, load_config
from pretrain.config.errors import ArgumentParser

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "demo-decoder.yaml"
SIZES = (256, 512, 1024)
RUN = [
    "model.max_seq_len=64",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.warmup_steps=2",
    "train.val_every=0",
    "train.val_sequences=8",
    "train.log_every=1",
    "stability.plot_at_end=false",
    "checkpoint.keep_last=2",
]
"""What the bench sets on the config: tiny steps (a checkpoint's size does not depend on the batch), one
validation at the end, the older checkpoints pruned (disk)."""
ASYNC_PARTS = ("snapshot_s", "copy_wait_s", "commit_s", "wait_s", "copy_s", "write_s")
"""An asynchronous save's parts (the checkpointer's per-save record): the snapshot (the copy to host memory, or
with ``checkpoint.overlap_copy`` its structure only), the next update's wait for the background copy, the loop's
share of the commit at later step boundaries (rank 0's commit runs in the background) and any wait for a write
the next save caught up with stall the loop; the background copy (``copy_s``) and write (write, hash, fsync) do
not."""


def size_overrides(hidden: int, layers: int, workers: int, zero_stage: int) -> list[str]:
    """The model of one size: ``hidden`` wide, ``layers`` deep, heads of 64, grouped-query attention (kv = heads/2),
    trained by ``workers`` data-parallel workers, one data stream each, at ZeRO ``zero_stage``."""
    heads = max(1, hidden // 64)
    return [
        f"model.hidden_size={hidden}",
        f"model.num_layers={layers}",
        f"model.num_heads={heads}",
        f"model.num_kv_heads={max(1, heads // 2)}",
        f"cluster.num_workers={workers}",
        f"data.num_streams={workers}",
        f"train.global_batch_size={workers}",
        f"zero.stage={zero_stage}",
    ]


def async_key(config: str | Path, overrides: list[str]) -> str:
    """'' when the config has ``checkpoint.async``, else why the asynchronous column is unavailable."""
    try:
        load_config(config, [*overrides, "checkpoint.async=true"])
    except ConfigError as e:
        return f"checkpoint.async is not a config key here ({e})"
    return ""


def launcher(config: str | Path, overrides: list[str]) -> list[str]:
    """``python``'s arguments before ``-m pretrain``: ``torchrun``'s for a run of several workers without Ray
    (``cluster.use_ray=false``), as a user launches one on a node without Ray; none otherwise (Ray starts them)."""
    cluster = load_config(config, overrides).cluster
    if cluster.num_workers > 1 and not cluster.use_ray:
        return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cluster.num_workers)]
    return []


def raw_write_seconds(directory: Path, nbytes: int, chunk: int = 16 << 20) -> float:
    """Seconds for one sequential write of ``nbytes`` (incompressible) into a new file in ``directory`` and its
    fsync: the least time this filesystem needs to make that many bytes durable. Dirty pages of earlier writes are
    flushed first, so they are not counted; the file is removed."""
    buf = memoryview(os.urandom(max(1, min(chunk, nbytes))))
    path = Path(directory) / f".raw-write-{uuid.uuid4().hex[:8]}"
    os.sync()
    try:
        t0 = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            left = nbytes
            while left > 0:
                left -= f.write(buf[: min(left, len(buf))])
            os.fsync(f.fileno())
        return time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)


class Session:
    """A temporary MLflow store and checkpoint root under ``parent``; ``python [LAUNCHER] -m pretrain`` runs in it
    from the current directory (relative data paths and the tokenizer cache resolve as for the user)."""

    def __init__(self, parent: Path, timeout: float, launcher: Sequence[str] = ()):
        parent.mkdir(parents=True, exist_ok=True)
        self.launcher = list(launcher)
        self.dir = Path(tempfile.mkdtemp(prefix="pretrain-bench-ckpt-", dir=parent)).resolve()
        self.runs, self.timeout = self.dir / "runs", timeout
        path = os.environ.get("PYTHONPATH")
        self.env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": f"sqlite:///{self.dir / 'mlflow.db'}",
            "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
        }

    def pretrain(self, *args: str) -> dict:
        """Run ``python -m pretrain ARGS`` here; the summary of the run it wrote (the newest)."""
        cmd = [sys.executable, *self.launcher, "-m", "pretrain", *args, f"checkpoint.dir={self.runs}"]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun stops its ranks on it (each in a session of its own, which a SIGKILL of
            # torchrun would leave running); the command alone stops its run on it too
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise RuntimeError(
                f"bench --checkpoint: `{' '.join(cmd[1:])}` ran over --timeout {self.timeout:g} s"
            ) from None
        summaries = sorted(self.runs.glob(f"*/{SUMMARY}"), key=lambda p: p.stat().st_mtime)
        if proc.returncode != 0 or not summaries:
            raise RuntimeError(
                f"bench --checkpoint: `{' '.join(cmd[1:])}` failed (exit {proc.returncode}):\n" + (out + err)[-3000:]
            )
        return json.loads(summaries[-1].read_text())

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def save_records(summary: dict) -> list[dict]:
    """One dict per save of the run (``step``, ``stall_s``, ...): the checkpointer's ``checkpoint_saves``; from a
    checkpointer without per-save records (synchronous saves only), every save at the mean of the loop time it
    spent in them (``checkpoint_seconds`` over ``checkpoints``), at step 0."""
    if "checkpoint_saves" in summary:
        return list(summary["checkpoint_saves"])
    n = int(summary.get("checkpoints", 0))
    return [{"step": 0, "stall_s": summary["checkpoint_seconds"] / n}] * n if n else []


def before_last(summary: dict, key: str = "stall_s") -> list[float]:
    """``key`` (the loop stall) of the saves before the run's last step (all saves when there are none)."""
    records = save_records(summary)
    mid = [r[key] for r in records if r["step"] < summary.get("step", 0) and key in r]
    return mid or [r[key] for r in records if key in r]


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def size_row(
    hidden: int, sync: dict, resume: dict, raw_write_s: float, asyn: dict | None, async_unavailable: str = ""
) -> dict:
    """One size's numbers from its runs' summaries (synchronous run, its resume, the asynchronous run or None) and
    the raw write of the same bytes."""
    nbytes = int(sync["checkpoint_bytes"])
    sync_stalls = before_last(sync)
    sync_stall = _mean(sync_stalls)
    resume_bytes = resume.get("resume_hash_bytes_per_rank", [])
    row = {
        "hidden": hidden,
        "checkpoint_bytes": nbytes,
        "checkpoint_gb": nbytes / 1e9,
        "saves_timed": len(sync_stalls),
        "sync_stall_s": sync_stall,
        "sync_stall_s_each": sync_stalls,
        "sync_stall_s_per_gb": sync_stall / (nbytes / 1e9) if sync_stall is not None and nbytes else None,
        "raw_write_s": raw_write_s,
        "sync_save_vs_raw": sync_stall / raw_write_s if sync_stall is not None and raw_write_s > 0 else None,
        "hash_s_per_rank": sync.get("checkpoint_hash_s_per_rank", []),
        "hash_bytes_per_rank": sync.get("checkpoint_hash_bytes_per_rank", []),
        "resume_time_to_first_step_s": resume.get("time_to_first_step_s"),
        "resume_hash_s_per_rank": resume.get("resume_hash_s_per_rank", []),
        "resume_hash_bytes_per_rank": resume_bytes,
        "resume_hashes_each_byte_once": bool(resume_bytes) and sum(resume_bytes) == nbytes,
    }
    if asyn is None:
        row.update(async_stall_s=None, async_stall_frac=None, async_unavailable=async_unavailable or "skipped")
    else:
        async_stalls = before_last(asyn)
        async_stall = _mean(async_stalls)
        row.update(
            async_stall_s=async_stall,
            async_stall_s_each=async_stalls,
            async_stall_frac=async_stall / sync_stall if async_stall is not None and sync_stall else None,
            async_checkpoint_bytes=asyn.get("checkpoint_bytes"),
            **{f"async_{k}": _mean(before_last(asyn, k)) for k in ASYNC_PARTS},
            async_snapshot_gb_max=asyn.get("checkpoint_snapshot_gb_max"),
            async_hash_s_per_rank=asyn.get("checkpoint_hash_s_per_rank", []),
        )
    return row


def targets(rows: list[dict]) -> dict:
    """The targets, at the largest size (async stall <= 10% of sync, sync save <= 1.5x the raw write)
    and at every size (a resume hashes each byte once); None when not measured."""
    big = max(rows, key=lambda r: r["checkpoint_bytes"])
    frac, ratio = big["async_stall_frac"], big["sync_save_vs_raw"]
    return {
        "largest_hidden": big["hidden"],
        "async_stall_frac_at_largest": frac,
        "async_stall_le_10pct_of_sync": None if frac is None else frac <= 0.10,
        "sync_save_vs_raw_at_largest": ratio,
        "sync_save_le_1_5x_raw": None if ratio is None else ratio <= 1.5,
        "resume_hashes_each_byte_once": all(r["resume_hashes_each_byte_once"] for r in rows),
    }


def measure_size(
    config: str | Path, overrides: list[str], hidden: int, a: argparse.Namespace, why_no_async: str
) -> dict:
    """Run one size (see the module doc); its temporary directories are removed before returning."""
    # The last step saves too, spaced like the others: the saves timed do not wait for it, nor it for them.
    over = [
        *RUN,
        *size_overrides(hidden, a.layers, a.workers, a.zero_stage),
        *overrides,
        f"checkpoint.every_steps={a.every}",
        f"train.max_steps={a.every * (a.saves + 1)}",
    ]
    mode = [] if why_no_async else ["checkpoint.async=false"]
    ranks = launcher(config, over)
    session = Session(Path(a.dir), a.timeout, ranks)
    try:
        sync = session.pretrain("train", str(config), *over, *mode)
        raw_s = raw_write_seconds(session.runs, int(sync["checkpoint_bytes"]))
        resume = session.pretrain("resume", sync["run_id"], f"train.max_steps={sync['step'] + 1}")
    finally:
        session.close()
    asyn = None
    if not why_no_async and not a.no_async:
        session = Session(Path(a.dir), a.timeout, ranks)
        try:
            asyn = session.pretrain("train", str(config), *over, "checkpoint.async=true")
        finally:
            session.close()
    return size_row(hidden, sync, resume, raw_s, asyn, why_no_async)


def bench(a: argparse.Namespace) -> dict:
    path = next((r for r in a.rest if "=" not in r), str(DEFAULT_CONFIG))
    overrides = [r for r in a.rest if "=" in r]
    why_no_async = async_key(path, overrides)
    rows = []
    for hidden in a.sizes:
        print(f"[bench] checkpoint: hidden {hidden} ...", file=sys.stderr, flush=True)
        rows.append(measure_size(path, overrides, hidden, a, why_no_async))
    return {
        "config": Path(path).stem,
        "layers": a.layers,
        "workers": a.workers,
        "zero_stage": a.zero_stage,
        "every_steps": a.every,
        "saves": a.saves,
        "dir_filesystem": str(Path(a.dir).resolve()),
        "async_unavailable": why_no_async or ("skipped (--no-async)" if a.no_async else ""),
        "sizes": rows,
        "targets": targets(rows),
    }


def table(result: dict) -> str:
    """The human-readable form: one line per size, then the targets."""
    cols = [
        ("hidden", "hidden", "{}"),
        ("GB", "checkpoint_gb", "{:.3f}"),
        ("sync stall s", "sync_stall_s", "{:.2f}"),
        ("async stall s", "async_stall_s", "{:.2f}"),
        ("async/sync", "async_stall_frac", "{:.1%}"),
        ("raw write s", "raw_write_s", "{:.2f}"),
        ("sync/raw", "sync_save_vs_raw", "{:.2f}"),
        ("hash s/rank", "hash_s_per_rank", "{}"),
        ("resume->step s", "resume_time_to_first_step_s", "{:.1f}"),
        ("resume 1x", "resume_hashes_each_byte_once", "{}"),
    ]

    def cell(row: dict, key: str, fmt: str) -> str:
        v = row.get(key)
        if v is None:
            return "n/a"
        if isinstance(v, list):
            return "/".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in v)
        return fmt.format(v)

    lines = ["  ".join(f"{h:>14}" for h, _, _ in cols)]
    lines += ["  ".join(f"{cell(r, k, f):>14}" for _, k, f in cols) for r in result["sizes"]]
    if result["async_unavailable"]:
        lines.append(f"async: unavailable: {result['async_unavailable']}")
    lines += [f"{k:<32} {v}" for k, v in result["targets"].items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh bench --checkpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument(
        "--sizes",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=list(SIZES),
        help="hidden sizes, comma-separated (default 256,512,1024; e.g. --sizes 256 for a quick check)",
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--every", type=int, default=4, help="checkpoint.every_steps")
    p.add_argument("--saves", type=int, default=3, help="saves timed (before the last step's)")
    p.add_argument(
        "--dir",
        default="checkpoints",
        help="where the runs write (the filesystem measured); a temporary directory in it is removed",
    )
    p.add_argument("--no-async", action="store_true", help="skip the asynchronous runs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per training run")
    p.add_argument("rest", nargs="*", help="CONFIG.yaml and key=value overrides")
    a = p.parse_args([x for x in argv if x != "--checkpoint"])
    if not a.sizes or min(a.sizes) < 64 or a.every < 1 or a.saves < 1:
        raise ConfigError("bench --checkpoint: --sizes must be >= 64, --every and --saves >= 1")
    result = bench(a)
    print(json.dumps(result, indent=1) if a.json else table(result), flush=True)
    return 0
