"""What the studies (``bench --growth``, ``bench --layer-drop --quality``) share: real training runs in this process
as MLflow child runs of one parent run per study, validation curves read back from MLflow (loss against training
FLOPs and against training seconds); the arithmetic that turns curves into a saving is :mod:`benchmarks.curves`.

Each run is a normal run (``prepare_new`` then ``cluster.launch.run``), so the study measures what a user trains;
``cluster.use_ray=false`` keeps one process per run on this machine."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.curves import Curve

ROOT = Path(__file__).resolve().parents[1]
VAL_POINTS = 25
"""Validations in a run on a study's budget (evenly spaced in FLOPs)."""

MAX_EPOCHS = 4
"""The most passes over a study corpus a run may make (Muennighoff et al. 2023: up to 4 epochs are nearly as good
as fresh data)."""


def vocab_of(overrides: list[str], default: int) -> int:
    """The tokenizer vocabulary the overrides ask for (their last ``data.tokenizer_vocab_size=``), else ``default``."""
    values = [o.split("=", 1)[1] for o in overrides if o.startswith("data.tokenizer_vocab_size=")]
    return int(values[-1]) if values else default


def corpus_overrides(overrides: list[str], vocab_size: int) -> tuple[list[str], str, dict | None]:
    """The study corpus: the ``data.sources`` the overrides name, if they do; else the installed packages' sources
    and docs (:mod:`benchmarks.corpus`, built at ``vocab_size`` on first use, then cached), with its validation
    split and its tokenizer. (overrides, a line naming it, its manifest or None). Runs never repeat data unless the
    study sets ``data.repeat=true`` (a run that would stops with 'data exhausted' and the study fails)."""
    if any(o.startswith("data.sources") for o in overrides):
        return ["data.repeat=false"], "data.sources from the command line", None
    from benchmarks.corpus import build
    from benchmarks.corpus import overrides as corpus_data

    manifest = build(vocab_size=vocab_size, say=lambda line: print(line, file=sys.stderr, flush=True))
    name = (
        f"the installed packages' Python sources and docs ({len(manifest['packages'])} packages, "
        f"{manifest['train']['tokens']:,} training tokens at a {vocab_size:,}-token vocabulary)"
    )
    return [*corpus_data(manifest), "data.repeat=false"], name, manifest


def study_base(vocab: int, corpus: list[str], overrides: list[str], *extra: str, val_sequences: int = 64) -> list[str]:
    """The overrides a study's runs start from: in process on one worker, no checkpoints and no end-of-run plot,
    the stability monitor logging its events but acting on none (``stability.policy=log``: every compared run takes
    every step it is given, so equal FLOPs are equal training), progress every 50 steps, 20 warm-up steps (and 20
    re-warm steps after a growth), 3 % of the documents held out and ``val_sequences`` of them scored, the vocabulary
    ``vocab``; then the study's own ``extra``, the ``corpus`` and the user's ``overrides`` (last, so that they win).
    Every study starts from the same base, so a run two studies share (the target from scratch on a budget) has one
    config, and a later study can reuse it (:mod:`benchmarks.reuse`)."""
    return [
        "cluster.use_ray=false",
        "cluster.num_workers=1",
        "checkpoint.every_steps=0",
        "stability.plot_at_end=false",
        "stability.policy=log",
        "train.log_every=50",
        "train.warmup_steps=20",
        "growth.rewarm_steps=20",
        "data.val_holdout=0.03",
        f"train.val_sequences={val_sequences}",
        f"model.vocab_size={vocab}",
        f"data.tokenizer_vocab_size={vocab}",
        *extra,
        *corpus,
        *overrides,
    ]


def model_parameters(study: Study, extra: list[str]) -> int:
    """Parameters of the model the study's config with ``extra`` builds (tied embeddings once)."""
    import torch

    from pretrain.model.counting import num_parameters
    from pretrain.model.transformer import SkipInitOnMeta, Transformer

    cfg = study.config(extra)
    with torch.device("meta"), SkipInitOnMeta():
        return num_parameters(Transformer(cfg.model, cfg.moe))


def budget_flops(cfg, tokens: float) -> float:
    """The training FLOPs of ``tokens`` tokens of ``cfg``'s model at its sequence length: a study's budget."""
    from pretrain.config import make_plan
    from pretrain.model import flops_per_token

    return tokens * flops_per_token(cfg.model, make_plan(cfg, cfg.cluster.num_workers).seq_len, cfg.moe)


def budget_overrides(flops: float, points: int) -> list[str]:
    """A run on the FLOPs budget ``flops`` (``train.max_flops``: the steps follow from the model) validated at
    ``points`` evenly spaced FLOPs."""
    return [f"train.max_flops={flops:.6g}", "train.val_every=0", f"train.val_every_flops={flops / points:.6g}"]


def epochs(tokens: float, manifest: dict | None, what: str) -> float | None:
    """Passes over the corpus's training split that ``tokens`` make (None without a manifest); more than
    :data:`MAX_EPOCHS` stops the study (``ConfigError``: one line naming ``what``, exit 2)."""
    if manifest is None:
        return None
    n = tokens / manifest["train"]["tokens"]
    if n > MAX_EPOCHS:
        from pretrain.config import ConfigError

        raise ConfigError(
            f"{what}: reads {tokens:,.0f} tokens, {n:.2f} epochs of the corpus's {manifest['train']['tokens']:,} "
            f"training tokens (at most {MAX_EPOCHS}): use a smaller budget or model"
        )
    return n


@contextlib.contextmanager
def _working_dir(path: Path, tracking_uri: str):
    old_cwd, old_uri = os.getcwd(), os.environ.get("MLFLOW_TRACKING_URI")
    os.chdir(path)
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri
    try:
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.pop("MLFLOW_TRACKING_URI", None)
        if old_uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = old_uri


def _curve(client, run_id: str, x_key: str) -> Curve:
    """(x, val/loss) at every validation of ``run_id`` in ``client``'s store, x being the metric ``x_key``."""

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    loss, xs = history("val/loss"), history(x_key)
    return [(xs[s], loss[s]) for s in sorted(loss) if s in xs]


def _threads(run) -> int | None:
    from pretrain.train.tracking import THREADS_TAG

    value = run.data.tags.get(THREADS_TAG, "")
    return int(value) if value.isdigit() else None


def seconds_comparable(*runs: RunCurves) -> bool:
    """Whether the runs' training seconds can be compared: each recorded the threads it trained with, all equal (a
    run reused from a study that ran several at once may have had fewer cores than one trained alone)."""
    threads = {r.threads for r in runs}
    return len(threads) == 1 and None not in threads


@dataclass
class RunCurves:
    """One finished run of a study: its id, validation loss against FLOPs and against training seconds, and what
    ``prune`` or ``eval`` read its model from (``source``: its run id in the study's store, or the checkpoint
    directory of a run reused from another store; ``tracking_uri``: the store that holds the run's metrics when it
    is not the study's own, as for a reused run)."""

    run_id: str
    flops: Curve
    seconds: Curve
    steps: int
    config: dict = field(default_factory=dict)
    source: str = ""
    tracking_uri: str = ""
    threads: int | None = None
    """The torch threads per worker it trained with (None: not recorded, a run made before they were): seconds are
    comparable between runs of equal threads only."""

    def __post_init__(self) -> None:
        self.source = self.source or self.run_id

    @property
    def final_loss(self) -> float:
        return self.flops[-1][1]


class Study:
    """A parent MLflow run (``name``) in a fresh directory under ``.cache/`` (runs, checkpoints and the MLflow store
    stay there for inspection), whose :meth:`train` runs are its children; a run that matches a finished run of the
    stores under ``reuse`` is read from there instead (:mod:`benchmarks.reuse`; listed in :attr:`reused`)."""

    def __init__(
        self, name: str, base_config: Path, base: list[str], root: Path | None = None, reuse: tuple[Path, ...] = ()
    ) -> None:
        from mlflow import MlflowClient

        from benchmarks.reuse import stores

        self.reuse = [f"sqlite:///{db}" for db in stores(list(reuse))]
        self.reused: dict[str, dict[str, str]] = {}
        """Label -> {"tracking_uri", "run_id"} of every run read from an earlier study."""
        self.name, self.base_config, self.base = name, base_config, base
        self.work = (root or ROOT / ".cache") / name / time.strftime("%Y%m%d-%H%M%S")
        self.work.mkdir(parents=True, exist_ok=True)
        self.uri = f"sqlite:///{self.work}/mlflow.db"
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(name)
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.parent = self.client.create_run(exp_id, run_name=name).info.run_id
        self.tokenizer: list[str] = []

    def config(self, extra: list[str]):
        from pretrain.config import load_config

        return load_config(self.base_config, [*self.base, *self.tokenizer, *extra])

    def train(self, label: str, extra: list[str], checkpoint: bool = False) -> RunCurves:
        """Train ``base + extra`` as a child run named ``label`` (or reuse a matching earlier run; ``checkpoint``:
        the study reads the run's model, so only one whose checkpoints are still on disk); the first run's tokenizer
        is every later run's."""
        with self.inside():
            cfg = self._labelled(label, extra)
            earlier = self._earlier(label, cfg, checkpoint)
        return earlier if earlier is not None else self._train_here(label, cfg)

    def _train_here(self, label: str, cfg, job=None) -> RunCurves:
        """Train ``cfg`` in this process as the run ``label`` (``job``: already prepared)."""
        from cluster.launch import run

        with self.inside():
            job = job or self._prepare(label, cfg)
            try:
                final = run(job, cfg.cluster)
            except BaseException:
                self._failed(job.run_id)
                raise
        return self._finished(label, cfg, job.run_id, final)

    def train_many(self, runs: list[tuple[str, list[str]]], jobs: int = 1, checkpoint: bool = False) -> list[RunCurves]:
        """:meth:`train` of each (label, extra) of ``runs``, at most ``jobs`` side by side
        (:mod:`benchmarks.side_by_side`: each in its own process on its share of the CPUs); a run that matches an
        earlier one is read, not trained (``checkpoint``: as for :meth:`train`); a single run left to train trains in
        this process. Runs that train through Ray (``cluster.use_ray=true``) train one at a time.
        Without a given tokenizer (``data.tokenizer``) the first run is prepared (its tokenizer trained) before the
        others' configs are made, so that they read its tokenizer, as one at a time."""
        from benchmarks.side_by_side import run_side_by_side

        if jobs > 1 and runs and not self.config(runs[0][1]).cluster.trains_in_process():
            print(f"[{self.name}] runs that train through Ray train one at a time (not --jobs {jobs})", flush=True)
            jobs = 1
        if jobs <= 1:
            return [self.train(label, extra, checkpoint) for label, extra in runs]
        out: list[RunCurves | None] = [None] * len(runs)
        todo: list[tuple[int, str, Any]] = []
        jobs_of: dict[int, Any] = {}  # todo index -> its prepared run
        try:
            for i, (label, extra) in enumerate(runs):
                with self.inside():
                    cfg = self._labelled(label, extra)
                    out[i] = self._earlier(label, cfg, checkpoint)
                    if out[i] is None and not self.tokenizer and not cfg.data.tokenizer:
                        jobs_of[len(todo)] = self._prepare(label, cfg)
                if out[i] is None:
                    todo.append((i, label, cfg))

            def tasks():
                for k, (_, label, cfg) in enumerate(todo):
                    if k not in jobs_of:
                        with self.inside():
                            jobs_of[k] = self._prepare(label, cfg)
                    yield label, _train_in, (jobs_of[k], cfg.cluster, str(self.work), self.uri)

            def done(k: int, final: dict) -> None:
                i, label, cfg = todo[k]
                out[i] = self._finished(label, cfg, jobs_of[k].run_id, final)

            if len(todo) == 1:  # alone: in this process, on every CPU
                i, label, cfg = todo[0]
                out[i] = self._train_here(label, cfg, jobs_of.pop(0, None))
            elif todo:
                run_side_by_side(tasks(), min(jobs, len(todo)), done)
        except BaseException:
            for k, job in jobs_of.items():
                if k >= len(todo) or out[todo[k][0]] is None:
                    self._failed(job.run_id)
            raise
        return [r for r in out if r is not None]

    def _labelled(self, label: str, extra: list[str]):
        """The config of the run ``label`` of the study's experiment (:meth:`config` of ``extra``)."""
        return self.config([f"tracking.experiment={self.name}", f"tracking.run_name={label}", *extra])

    def _prepare(self, label: str, cfg):
        """The run ``label`` of ``cfg``, created (in the study's directory) and announced."""
        from pretrain.checkpoint.layout import RUN_TOKENIZER
        from pretrain.driver.prepare import prepare_new

        job = prepare_new(cfg, tags={"mlflow.parentRunId": self.parent, "study.variant": label})
        self.tokenizer = self.tokenizer or [f"data.tokenizer={Path(job.run_dir) / RUN_TOKENIZER}"]
        print(f"[{self.name}] {label}: run {job.run_id}", flush=True)
        return job

    def _failed(self, run_id: str) -> None:
        self.client.set_terminated(run_id, "FAILED")
        self.client.set_terminated(self.parent, "FAILED")

    def _finished(self, label: str, cfg, run_id: str, final: dict) -> RunCurves:
        """The curves of the run ``label`` that trained ``cfg`` and ended with ``final`` (marked finished); one
        that stopped short of its steps is refused."""
        from pretrain.config import to_dict

        self.client.set_terminated(run_id, "FINISHED")
        out = RunCurves(
            run_id,
            self.curve(run_id, "val/flops"),
            self.curve(run_id, "val/train_s"),
            int(final.get("step", 0)),
            to_dict(cfg),
            threads=_threads(self.client.get_run(run_id)),
        )
        if out.steps < cfg.train.max_steps:
            raise RuntimeError(f"{label}: stopped at step {out.steps} of {cfg.train.max_steps} (data exhausted?)")
        self.client.log_text(run_id, json.dumps({"flops": out.flops, "seconds": out.seconds}), "study/curves.json")
        return out

    def _earlier(self, label: str, cfg, checkpoint: bool) -> RunCurves | None:
        """The curves of a finished run of the ``reuse`` stores that trained ``cfg`` (whatever it was named there;
        ``checkpoint``: and whose checkpoints are on disk), or None."""
        from mlflow import MlflowClient

        from benchmarks.reuse import find
        from pretrain.checkpoint.layout import RUN_TOKENIZER
        from pretrain.config import flatten, to_dict
        from pretrain.config.paths import resolve_paths
        from pretrain.driver.budget import resolve_budget

        if not self.reuse:
            return None
        want = resolve_budget(resolve_paths(copy.deepcopy(cfg)), say=lambda _line: None)  # as the run logs it
        hit = find(self.reuse, flatten(to_dict(want)), want.train.max_steps)
        if hit is None:
            return None
        uri, found = hit
        run_id = found.info.run_id
        root = found.data.tags.get("pretrain.checkpoint_root")
        if checkpoint and not (root and Path(root).is_dir()):
            gone = f"run {run_id} of {uri} matches, but its checkpoints are gone: training it"
            print(f"[{self.name}] {label}: {gone}", flush=True)
            return None
        if root and not self.tokenizer:
            self.tokenizer = [f"data.tokenizer={Path(root) / RUN_TOKENIZER}"]
        self.reused[label] = {"tracking_uri": uri, "run_id": run_id, "run_name": found.info.run_name}
        print(f"[{self.name}] {label}: reused run {run_id} ({found.info.run_name!r}) of {uri}", flush=True)
        client = MlflowClient(tracking_uri=uri)
        return RunCurves(
            run_id,
            _curve(client, run_id, "val/flops"),
            _curve(client, run_id, "val/train_s"),
            want.train.max_steps,
            to_dict(want),
            root if checkpoint else run_id,
            uri,
            _threads(found),
        )

    def steps(self, extra: list[str]) -> int:
        """The steps a run of ``base + extra`` trains (a FLOPs budget resolved as the run resolves it)."""
        from pretrain.driver.budget import resolve_budget

        return resolve_budget(self.config(extra), say=lambda _line: None).train.max_steps

    def inside(self):
        """A context in the study's directory with its MLflow store (for ``prune``, ``eval`` and the like)."""
        return _working_dir(self.work, self.uri)

    def curve(self, run_id: str, x_key: str) -> Curve:
        """(x, val/loss) at every validation of ``run_id``, x being the metric ``x_key`` logged with it."""
        return _curve(self.client, run_id, x_key)

    def finish(self, result: dict, figure: Path | None) -> None:
        """The study's JSON (and figure) as artifacts of the parent run, which ends."""
        path = self.work / f"{self.name}.json"
        path.write_text(json.dumps(result, indent=1))
        self.client.log_artifact(self.parent, str(path), "study")
        if figure is not None:
            self.client.log_artifact(self.parent, str(figure), "study")
        self.client.set_terminated(self.parent)


def _train_in(job, cluster, work: str, uri: str) -> dict:
    """Train ``job`` in this process, in the study's directory ``work`` with its MLflow store ``uri`` (a run side by
    side: :meth:`Study.train_many`)."""
    from cluster.launch import run

    # a world of one of its own, not the rendezvous that a run trained in the study's process left in its environment
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    with _working_dir(Path(work), uri):
        return run(job, cluster)
