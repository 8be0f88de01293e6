"""The harness of the multi-rank tests, shared by the feature files instead of their own copies.

* the one tiny model (``TINY_MODEL``, ``tiny_config``; ``tiny_model(**changes)`` where a test needs it changed),
  learnable global batches and each rank's shard of one;
* ``run_distributed(fn, world_size, *args)``: real processes joined by a real gloo group: fresh ones
  (``pretrain/train/spawn.py``), or with ``fresh=False`` the session's processes of that world size, started once and
  kept (``tests/rank_pool.py``), which skips the seconds every fresh process spends on imports and its first DeepSpeed
  engine;
* ``train_steps``: steps of a DeepSpeed module (``build_module`` + ``run_step``) on this rank's shards, and
  ``step_losses``: "N steps on this rank with these config overrides -> the per-step losses";
* cases as a table of config overrides (``Case``: id, overrides, world size), as torchtitan's integration tests keep
  them: ``run_cases`` runs a whole table in one set of processes per world size, so a module-scoped fixture runs it
  once and a test parametrized over the rows checks each one;
* the real training loop on ranks (``train_jobs``, ``run_jobs``) and what it logged (``metric_history``);
* the command line (``cli``: ``python -m pretrain`` and the exit code it must end with; ``start_cli``: one
  that runs on while the test signals or follows it; ``run_id_of``) and the
  tiny end-to-end run (``E2E``, ``TASKS``) that the reference run, the end-to-end, multi-node, console and MoE tests
  share.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tests.empty_store import empty_store
from tests.rank_pool import close_pools, run_distributed

__all__ = [
    "CONFIG",
    "E2E",
    "PYTHON",
    "ROOT",
    "TASKS",
    "TINY_MODEL",
    "Case",
    "case_ids",
    "close_pools",
    "cli",
    "cli_env",
    "learnable_batches",
    "metric_history",
    "run_cases",
    "run_distributed",
    "run_id_of",
    "run_jobs",
    "shard",
    "start_cli",
    "step_losses",
    "tiny_config",
    "tiny_model",
    "train_jobs",
    "train_steps",
]

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CONFIG = str(ROOT / "configs" / "demo-decoder.yaml")

# -- the tiny model, its batches and their shards --------------------------------------------------------------

VOCAB, SEQ = 101, 16
TINY_MODEL = (
    "model.vocab_size=101",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.max_seq_len=16",
)
"""The tests' one tiny model: 2 blocks of width 32 over a vocabulary of 101, sequences of 16 tokens. Tests that need
another one say how it differs: ``tiny_model(...)``."""


def tiny_model(**changes: object) -> list[str]:
    """The tiny model's overrides (``TINY_MODEL``) with ``changes`` to it: ``tiny_model(num_layers=4,
    num_kv_heads=2)`` sets ``model.num_layers=4`` and adds ``model.num_kv_heads=2``; ``None`` leaves a key unset (the
    preset's value, or for ``vocab_size`` the run's tokenizer's)."""
    model: dict[str, object] = dict(o.removeprefix("model.").split("=", 1) for o in TINY_MODEL)
    for key, value in changes.items():
        if value is None:
            model.pop(key, None)
        else:
            model[key] = str(value).lower() if isinstance(value, bool) else value
    return [f"model.{k}={v}" for k, v in model.items()]


def tiny_config(*overrides: str, preset: str | Path | None = None):
    """The run config of the tiny model (``TINY_MODEL``) with ``overrides`` applied after it, in order."""
    from pretrain.config import load_config

    return load_config(preset, [*TINY_MODEL, *overrides])


def learnable_batches(steps: int, batch: int, seed: int = 7) -> list[torch.Tensor]:
    """``steps`` global batches of (batch, SEQ) sequences counting up from a random start (mod VOCAB): learnable, so
    the loss visibly drops."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, 1), generator=g) + torch.arange(SEQ)) % VOCAB for _ in range(steps)]


def shard(ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of a global batch (rows ``rank * B/world`` on)."""
    per = ids.shape[0] // world
    return ids[rank * per : (rank + 1) * per]


def train_steps(
    module,
    batches: Sequence[torch.Tensor],
    rank: int,
    world: int,
    *,
    hooks: Sequence = (),
    seeds: bool = False,
    before: Callable[[int], None] | None = None,
    after: Callable[[int, Any], None] | None = None,
) -> list:
    """One optimizer step of ``module`` (a ``TrainModule``) per global batch on this rank's shard, with the schedule's
    LR; returns each step's ``StepResult``. ``seeds``: seed each micro-batch as the trainer does (dropout, sample
    drops); ``before(step)`` / ``after(step, result)`` run around each 0-based step, ``hooks`` inside it."""
    from pretrain.train.step import StepInput, dropout_seeds, run_step

    results = []
    for step, ids in enumerate(batches):
        if before is not None:
            before(step)
        part = shard(ids, module.plan.data_rank(rank), module.plan.world_size)  # ranks sharing sequences: the same
        ids_ = module.plan.micro_batch_ids(rank)
        micro_seeds = dropout_seeds(module.cfg.train.seed, step, ids_, module.plan.dims, rank) if seeds else None
        r = run_step(
            module,
            StepInput(step + 1, {"input_ids": part, "labels": part}, module.lr_at(step), micro_seeds),
            list(hooks),
        )
        results.append(r)
        if after is not None:
            after(step, r)
    return results


def step_losses(
    rank: int,
    world: int,
    overrides: Sequence[str],
    batches: Sequence[torch.Tensor],
    base: Sequence[str] = TINY_MODEL,
    check: Callable[[Any], None] | None = None,
) -> list[float]:
    """In a process of ``run_distributed``: build the module of ``base + overrides`` (``cluster.num_workers`` set to
    the world size), ``check(module)`` it, and train it on this rank's shards; the per-step (all-reduced) losses."""
    from pretrain.config import load_config
    from pretrain.train.module import build_module

    module = build_module(load_config(None, [*base, *overrides, f"cluster.num_workers={world}"]))
    if check is not None:
        check(module)
    return [r.loss for r in train_steps(module, batches, rank, world)]


# -- tables of cases ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One row of a table: an id (the test id), config overrides and the number of ranks that run them."""

    id: str
    overrides: tuple[str, ...]
    world_size: int


def case_ids(cases: Sequence[Case]) -> list[str]:
    return [c.id for c in cases]


def _run_rows(rank: int, world: int, worker: Callable, rows: list[tuple[str, list[str]]], args: tuple) -> dict:
    torch.set_num_threads(1)  # tiny models, one core per rank
    return {case_id: worker(rank, world, overrides, *args) for case_id, overrides in rows}


def run_cases(worker: Callable, cases: Sequence[Case], *args, timeout: float = 900.0) -> dict[str, list]:
    """Run every case of a table: one ``run_distributed`` per world size (the session's processes), which runs its
    cases in order (``worker(rank, world, overrides, *args)`` runs one; a module-level function, so that it pickles).
    Returns case id -> the ranks' results (rank order)."""
    ids = case_ids(cases)
    assert len(set(ids)) == len(ids), f"duplicate case ids: {ids}"
    out: dict[str, list] = {}
    for world in sorted({c.world_size for c in cases}, reverse=True):
        rows = [(c.id, list(c.overrides)) for c in cases if c.world_size == world]
        ranks = run_distributed(_run_rows, world, worker, rows, args, timeout=timeout, fresh=False)
        for case_id, _ in rows:
            out[case_id] = [r[case_id] for r in ranks]
    return out


# -- the real training loop on ranks ----------------------------------------------------------------------------


def train_jobs(rank: int, world: int, jobs: list[dict]) -> list[dict]:
    """In each process of ``run_distributed``: run the training function on each job (``Job`` as dict), in order."""
    from pretrain.train.worker import train_loop

    return [train_loop(job) for job in jobs]


def run_jobs(world: int, jobs: Sequence, timeout: float = 900.0, fresh: bool = True) -> list[list[dict]]:
    """Prepared jobs (``prepare_new``) trained in order by one set of ``world`` real gloo processes, without Ray; each
    rank's final results (rank order, then job order). ``fresh=False`` (the session's processes) only where no job
    resumes from a checkpoint that those processes wrote in an earlier call: a resume in fresh processes shows that
    the checkpoint, not state left in memory, carries the run."""
    return run_distributed(train_jobs, world, [asdict(j) for j in jobs], timeout=timeout, fresh=fresh)


def metric_history(run_id: str, key: str = "train/loss", uri: str | None = None) -> dict[int, float]:
    """step -> value of one metric of an MLflow run (the last logged value per step wins); ``uri``: the tracking
    store, else the current one (``MLFLOW_TRACKING_URI``)."""
    from mlflow import MlflowClient

    history = sorted(MlflowClient(uri).get_metric_history(run_id, key), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}


# -- the command line ----------------------------------------------------------------------------------------------


def cli_env(tmp_path: Path, store: bool = True) -> dict[str, str]:
    """The environment of a command run in ``tmp_path``: its own sqlite MLflow store (``store``: a migrated empty
    one put there unless one is, ``tests/empty_store.py``; False: none, for a test that checks the command makes
    none), this checkout's code."""
    if store:
        empty_store(tmp_path)
    env = dict(os.environ)
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def cli(
    work: Path,
    *args: str,
    expect: int | None = 0,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    ranks: int = 1,
    store: bool = True,
) -> subprocess.CompletedProcess:
    """``python -m pretrain ARGS`` in ``work`` (its own MLflow store unless ``env`` is given: ``cli_env(work,
    store)``), its output captured as
    text; asserts the exit code is ``expect`` (0: success, 2: a user error refused in one line, 1: an internal
    error; ``None``: any, the caller checks). ``ranks`` > 1: the command under ``torchrun --standalone
    --nproc_per_node RANKS`` (no Ray: pass ``cluster.use_ray=false``), as a user launches it without Ray. Returns
    the completed process (``returncode``, ``stdout``, ``stderr``)."""
    proc = subprocess.run(
        pretrain_command(*args, ranks=ranks),
        cwd=work,
        env=env or cli_env(work, store),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if expect is not None:
        assert proc.returncode == expect, (
            f"{args} exited {proc.returncode}, not {expect}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def pretrain_command(*args: str, ranks: int = 1) -> list[str]:
    """``python -m pretrain ARGS``; for ``ranks`` > 1 under ``torchrun --standalone --nproc_per_node RANKS``."""
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    return [PYTHON, *launcher, "-m", "pretrain", *args]


def start_cli(work: Path, *args: str, env: dict[str, str] | None = None, ranks: int = 1, **popen) -> subprocess.Popen:
    """:func:`cli`'s command started in ``work`` and not waited for: for a test that signals, kills or follows the
    command while it runs; ``popen``: ``subprocess.Popen``'s options (pipes, a session of its own). Text mode."""
    command = pretrain_command(*args, ranks=ranks)
    return subprocess.Popen(command, cwd=work, env=env or cli_env(work), text=True, **popen)


def run_id_of(stdout: str) -> str:
    """The MLflow run id a ``train`` / ``resume`` command printed."""
    for line in stdout.splitlines():
        if line.strip().startswith("MLflow run id"):
            return line.split()[-1]
    raise AssertionError(f"no run id in output:\n{stdout[-2000:]}")


E2E = [
    *tiny_model(hidden_size=64, num_kv_heads=2, max_seq_len=32, dropout=0.1, vocab_size=None),
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=3000",
    "data.num_streams=2",
    "data.shuffle_sequences=6",  # every resume of these runs is exact with the streams' shuffle buffers in its state
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=8",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.val_every=4",
    "train.val_sequences=8",
    "checkpoint.every_steps=2",
    "cluster.num_workers=2",
    "train.decay=constant",
    "stability.plot_at_end=false",
]
"""The tiny end-to-end run of ``configs/demo-decoder.yaml``: 2 Ray workers, 8 steps, a checkpoint every 2; without
the end-of-run plot (about 3 s of matplotlib per run; the session's ``reference`` run draws it and checks it)."""

TASKS = ["eval.tasks=[heldout_lastword]", "eval.max_examples=16"]


def session_processes(sid: int) -> list[dict]:
    """The live processes of session ``sid`` (e.g. a command started with ``start_new_session``), with their pid,
    name and command line; a zombie has ended (where PID 1 does not reap, it stays listed) and does not count."""
    import psutil  # a dependency of ray

    out = []
    for proc in psutil.process_iter(["pid", "name", "status", "cmdline"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.info["pid"]) == sid:
                out.append({k: proc.info[k] for k in ("pid", "name", "cmdline")})
        except OSError:  # gone meanwhile
            continue
    return out
