"""Driver-side preparation of a job: absolute paths, tokenizer, vocab size, MLflow run, run directory.

Runs once on the driver before any worker starts, so workers receive a fully resolved config
(tokenizer directory and vocab size included) and never train a tokenizer themselves.

:func:`preflight` comes first: the checks that need the file system (the checkpoint directory can be
created and written, the given tokenizer / HF model / resume directories exist) and the corpus checks of
:mod:`pretrain.data.sanity` (every source opened, a bounded prefix read, the split planned), and each
``growth.schedule`` entry applied to a weightless model (:func:`pretrain.driver.budget.check_growth_stages`).
They refuse a bad run with one :class:`ConfigError` line before an MLflow run or a run directory exists, and
(without a growth schedule, whose check builds meta-device models) before torch, transformers or Ray are imported
(this module imports them lazily), so within a second or two.
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.placement import check_local_layout
from cluster.requires import require_ray_for
from pretrain import invocation, timeline
from pretrain.checkpoint import layout
from pretrain.config import ConfigError, RunConfig, dump_yaml, to_dict
from pretrain.config.errors import clip, not_a
from pretrain.config.paths import resolve_paths
from pretrain.config.tree import BYTE_LEVEL_VOCAB
from pretrain.data.sanity import check_corpus, hub_sources
from pretrain.driver.budget import check_growth_stages, keep_resolved_budget, resolve_budget
from pretrain.driver.run_lock import hold_run
from pretrain.train import tracking
from pretrain.train.stop_request import stops_deferred

if TYPE_CHECKING:
    from pretrain.train.job import Job


def check_writable_dir(path: str, key: str) -> None:
    """``path`` is a directory we can write, or one we can create: its nearest existing ancestor is a
    writable directory (probed with a temporary file, which also catches read-only mounts and root)."""
    if not path or "://" in path:
        return
    target = Path(path)
    probe = target
    try:
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        if not probe.is_dir():
            why = f"{probe} is not a directory" if probe == target else f"cannot create it: {probe} is not a directory"
            raise ConfigError(f"{key}: {path}: {why}")
        with tempfile.TemporaryFile(dir=probe, prefix=".pretrain-probe-"):
            pass
    except OSError as e:
        what = "cannot write into it" if probe == target else f"cannot create it in {probe}"
        raise ConfigError(f"{key}: {path}: {what} ({e.strerror or e})") from None


def _check_dir(path: str, key: str, what: str) -> None:
    if path and not os.path.isdir(path):
        why = not_a(path, "a directory") or ("is not a directory" if os.path.exists(path) else "does not exist")
        raise ConfigError(f"{key}: {clip(path)} {why}{what}")


def _check_gpu_request(cfg: RunConfig) -> None:
    """``cluster.use_gpu=yes`` on this machine (no cluster address) without a GPU driver cannot start a worker."""

    local = not (cfg.cluster.address or os.environ.get("RAY_ADDRESS")) or cfg.cluster.trains_in_process()
    if cfg.cluster.use_gpu == "yes" and local and not any(Path(d).exists() for d in ("/dev/nvidiactl", "/dev/kfd")):
        raise ConfigError(
            "cluster.use_gpu: yes, but this machine has no GPU driver (no /dev/nvidiactl or /dev/kfd) "
            "and no cluster address is set; use auto (GPUs when there are) or no"
        )


def preflight(cfg: RunConfig, probe: bool = True, grown_at: int = 0) -> list[str]:
    """The driver's checks before anything is created (paths already absolute): directories, the worker layout
    (an embedded local Ray must be able to place it: :func:`cluster.placement.check_local_layout`), the growth
    schedule against the model (:func:`pretrain.driver.budget.check_growth_stages`), then the corpus
    (:func:`pretrain.data.sanity.check_corpus`). Sets ``data.piece_chars`` when the documents are
    too few for a document-level split, and says so in one line.

    ``probe=False`` (``train --dry-run``, which plans for another machine): only what this machine can check of
    any job, never waiting on the network; the GPU driver, the local CPUs and GPUs for the layout, and the hub
    datasets are not checked. Returns one line for each check left out, saying why. ``grown_at``: the step of the
    checkpoint whose stored config ``cfg`` is (a resume): the growths before it are in its model already."""
    check_writable_dir(cfg.checkpoint.dir, "checkpoint.dir")
    skipped = [] if probe else _not_probed(cfg)
    if probe:
        _check_gpu_request(cfg)
        require_ray_for(cfg.cluster)
        check_local_layout(cfg.cluster)
    m, d = cfg.model, cfg.data
    if not d.tokenizer and not m.init_from_hf and 0 < m.vocab_size < BYTE_LEVEL_VOCAB:
        raise ConfigError(
            f"model.vocab_size: {m.vocab_size} is smaller than the tokenizer this run trains (at least "
            f"{BYTE_LEVEL_VOCAB} tokens); set 0 to take the tokenizer's size"
        )
    _check_dir(cfg.data.tokenizer, "data.tokenizer", " (a saved Hugging Face tokenizer)")
    _check_dir(cfg.model.init_from_hf, "model.init_from_hf", " (a Hugging Face model directory)")
    _check_dir(cfg.checkpoint.resume_from, "checkpoint.resume_from", " (a committed checkpoint)")
    cfg.eval.check_files()
    if not m.init_from_hf:  # else the architecture is the Hugging Face model's, checked once it is adopted
        check_growth_stages(cfg, grown_at)
    elif cfg.moe.enabled and not grown_at and not cfg.checkpoint.resume_from:  # a new run
        raise ConfigError(
            f"model.init_from_hf: a dense model (importing Mixture-of-Experts models is not supported) and "
            f"moe.num_experts={cfg.moe.num_experts}; start it dense (moe.num_experts=0), then upcycle the run: "
            f"{invocation.command()} grow RUN_ID experts={cfg.moe.num_experts}"
        )
    plan = check_corpus(
        cfg.data,
        seq_len=cfg.model.max_seq_len,
        seed=cfg.train.seed,
        val_sequences=cfg.train.val_sequences,
        open_hub=probe,
    )
    cfg.data.piece_chars = plan.piece_chars
    if plan.message:
        print(f"[pretrain] {plan.message}", flush=True)
    _check_vocab_against_given_tokenizer(cfg)
    _check_mask_token(cfg)
    return skipped


def _check_mask_token(cfg: RunConfig) -> None:
    """A masked LM (an encoder) given a tokenizer without a mask token (``data.tokenizer``, or its token shards'),
    refused here rather than by the workers of a created run. The tokenizer a run trains has one."""
    from pretrain.data.shards.compat import shards_tokenizer

    tok = cfg.data.tokenizer or shards_tokenizer(cfg.data)
    if cfg.model.kind != "encoder" or not tok or cfg.model.init_from_hf:
        return
    from transformers import PreTrainedTokenizerFast

    from pretrain.data.tokenizer import mask_id

    try:
        loaded = PreTrainedTokenizerFast.from_pretrained(str(tok))
    except Exception:  # noqa: BLE001 - an unreadable directory is the tokenizer step's to report, in its words
        return
    mask_id(loaded, f"data.tokenizer: {tok}")


def _check_vocab_against_given_tokenizer(cfg: RunConfig) -> None:
    """A ``model.vocab_size`` below the size of the tokenizer the run is given (``data.tokenizer``, or its token
    shards'), refused here rather than after the run is created."""
    from pretrain.data.shards.compat import shards_tokenizer, tokenizer_vocab_size

    m = cfg.model
    tok = cfg.data.tokenizer or shards_tokenizer(cfg.data)
    if not m.vocab_size or not tok or m.init_from_hf or not (Path(tok) / "tokenizer.json").is_file():
        return
    length = tokenizer_vocab_size(tok)
    if m.vocab_size < length:
        raise ConfigError(
            f"model.vocab_size: {m.vocab_size} is smaller than the tokenizer ({length:,} tokens, {clip(tok)}); set 0 "
            "to take the tokenizer's size"
        )


def _not_probed(cfg: RunConfig) -> list[str]:
    """What ``preflight(probe=False)`` leaves out, one line each."""
    c, why = cfg.cluster, "(dry run: it plans the job, it does not probe this machine)"
    out = []
    if c.use_gpu == "yes":
        out.append(f"gpu: a GPU driver for cluster.use_gpu=yes {why}")
    if not c.trains_in_process():
        out.append(f"workers: room for {c.num_workers} workers x {c.cpus_per_worker:g} CPU(s) {why}")
    hub = [rs.hub_path for rs in hub_sources(cfg.data)]
    out += [f"data: hub dataset {name} not opened (dry run: no network)" for name in hub]
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


def _adopt_hf_model(cfg: RunConfig) -> None:
    """``model.init_from_hf``: take the architecture (and, if present, the tokenizer) of an HF dir."""
    from pretrain.export.hf import model_config_from_hf

    hf_dir = Path(cfg.model.init_from_hf)
    if not hf_dir.is_dir():
        raise ConfigError(f"model.init_from_hf: {hf_dir} is not a directory")
    try:
        cfg.model, _ = model_config_from_hf(hf_dir, base=cfg.model, max_seq_len=cfg.model.max_seq_len)
    except ValueError as e:
        raise ConfigError(f"model.init_from_hf: {e}") from None
    if (hf_dir / "tokenizer.json").is_file() and not cfg.data.tokenizer:
        cfg.data.tokenizer = str(hf_dir)
    print(f"[pretrain] initializing from Hugging Face model {hf_dir}", flush=True)


def _warn_if_not_exportable(cfg: RunConfig) -> None:
    from pretrain.export.hf import export_target

    hf_class, reason = export_target(cfg.model, cfg.moe)
    if hf_class is None:
        print(f"[pretrain] note: Hugging Face export: {reason}", flush=True)


def create_run(
    cfg: RunConfig, tags: dict[str, str] | None = None, complete: Callable[[Path], None] | None = None
) -> tuple[str, Path, str]:
    """The one way a run comes to exist (new, resumed from a checkpoint directory, derived by ``grow``/``prune``):
    its MLflow run (a local id when tracking is off) and its directory under ``checkpoint.dir``; then
    ``complete(run_dir)`` settles what needs the directory (tokenizer, vocab size), the config is validated and
    written as the run's config, logged to MLflow, and the run records its checkpoint root (how a run id finds
    its checkpoints); the values ``complete`` and validation settle are params ``resolved.<key>``. Returns (run
    id, run directory, tracking URI or ""). A run whose creation fails after its
    MLflow run exists ends ``FAILED`` (``KILLED`` when interrupted), never left ``RUNNING``."""
    uri = tracking.tracking_uri() if cfg.tracking.enabled else ""
    run_id = tracking.new_run(uri, cfg, tags) if uri else f"{tracking.LOCAL_RUN_PREFIX}{uuid.uuid4().hex[:12]}"
    run_dir = Path(cfg.checkpoint.dir) / run_id
    given = copy.deepcopy(cfg)
    with ended_on_error(uri, run_id):
        if uri:
            tracking.log_inputs(uri, run_id, cfg)  # the config as given: params (what the run was asked to train)
        run_dir.mkdir(parents=True, exist_ok=True)
        if complete is not None:
            complete(run_dir)
        cfg.validate(steps_known=True)  # a budget's steps are derived by now
        (run_dir / layout.RUN_CONFIG).write_text(dump_yaml(cfg))
        if uri:
            tracking.log_config(uri, run_id, cfg, artifact="config/resolved.yaml", given=given)  # resolved.* params
            tracking.Tracker(uri, run_id).set_tags({tracking.TAG_CKPT_ROOT: str(run_dir)})
    return run_id, run_dir, uri


@contextlib.contextmanager
def ended_on_error(uri: str, run_id: str) -> Iterator[None]:
    """The MLflow run ``run_id`` ends ``KILLED`` (an interrupt) or ``FAILED`` (any other error) when the block
    raises; the error goes on."""
    try:
        yield
    except BaseException as e:
        _end_run(uri, run_id, e)
        raise


def _end_run(uri: str, run_id: str, error: BaseException) -> None:
    """The run ends ``KILLED`` (``error`` is an interrupt, recorded in its tags) or ``FAILED``."""
    if uri:  # the error itself matters more than its record; a second stop waits for it
        with stops_deferred("ending the run (SIGKILL ends at once)"), contextlib.suppress(Exception):
            tracker = tracking.Tracker(uri, run_id)
            if isinstance(error, KeyboardInterrupt):
                tracker.set_tags(stop_tags(getattr(error, "signum", signal.SIGINT)))
            tracker.finish("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")


def ended_if_left_running(uri: str, run_id: str):
    """An exit callback for the ``hold`` of a run being created: when the command leaves on an error (a stop between
    the run's creation and the code that runs it, where no handler is yet in place) and the run is still
    ``RUNNING``, it ends as :func:`ended_on_error` ends it. A run that its runner already ended is left as it is."""

    def end(exc_type, exc, tb) -> None:
        if exc is None or not uri:
            return
        with contextlib.suppress(Exception):
            run = tracking.find_run(uri, run_id)
            if run is not None and run.info.status == "RUNNING":
                _end_run(uri, run_id, exc)

    return end


def stop_tags(signum: int) -> dict[str, str]:
    """The MLflow tags of a run that a stop (signal ``signum``) ended with no new checkpoint."""
    return {"pretrain.stop.signal": signal.Signals(signum).name, "pretrain.stop.checkpoint": "none (at once)"}


def prepare_new(
    cfg: RunConfig, tags: dict[str, str] | None = None, checked: bool = False, hold: ExitStack | None = None
) -> Job:
    """A fresh run: check it (:func:`preflight`; ``checked``: the caller did, on :func:`resolve_paths`' result),
    create the run (:func:`create_run`) with its tokenizer (trained or copied into the run directory) and vocab
    size. ``hold``: where the run's lock is entered (:mod:`pretrain.driver.run_lock`), held while it trains."""
    if not checked:
        cfg = resolve_paths(cfg)
        preflight(cfg)
    from pretrain.train.job import Job

    vocab_known = bool(cfg.model.vocab_size)

    def complete(run_dir: Path) -> None:
        from pretrain.data.tokenizer_cache import run_tokenizer

        if cfg.faults.slow_run_creation_s > 0:
            _say(f"faults.slow_run_creation_s: the run's creation sleeps {cfg.faults.slow_run_creation_s:g} s")
            time.sleep(cfg.faults.slow_run_creation_s)
        if cfg.model.init_from_hf:
            _adopt_hf_model(cfg)
            check_growth_stages(cfg)
        _warn_if_not_exportable(cfg)
        tok_dir = run_dir / layout.RUN_TOKENIZER
        timeline.enter("tokenizer")
        # a given tokenizer is copied, a trained one comes from the user's cache when the corpus is unchanged:
        # either way the run directory has its own copy (runs stay self-contained)
        length = run_tokenizer(cfg.data, tok_dir, say=lambda line: print(f"[pretrain] {line}", flush=True))
        timeline.enter("run_preparation")
        cfg.data.tokenizer = str(tok_dir)
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = _round_up(length, cfg.model.vocab_multiple)
        elif cfg.model.vocab_size < length:
            raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer ({length})")
        if fresh and not vocab_known:
            resolve_budget(cfg, say=_say, announce=True)  # FLOPs per token need the vocab size

    from pretrain.data.fingerprint import fingerprints

    fingerprint = fingerprints(cfg.data)  # what the run trains on, kept in every checkpoint
    fresh = not cfg.checkpoint.resume_from  # a resumed run keeps the steps derived when it was created
    if not fresh:
        keep_resolved_budget(cfg, cfg)
    elif cfg.model.vocab_size:  # derived steps known before the run's params are logged (else once known)
        resolve_budget(cfg, say=_say, announce=True)
    run_id, run_dir, uri = create_run(cfg, tags, complete)
    with ended_on_error(uri, run_id):
        if hold is not None:
            hold.enter_context(hold_run(run_dir, run_id))
            hold.push(ended_if_left_running(uri, run_id))
        init_weights = _import_hf_weights(cfg, run_dir) if cfg.model.init_from_hf else ""
    return Job(
        config=to_dict(cfg),
        run_id=run_id,
        run_dir=str(run_dir),
        tracking_uri=uri,
        init_weights=init_weights,
        data_fingerprint=fingerprint,
    )


def _import_hf_weights(cfg: RunConfig, run_dir: Path) -> str:
    """Convert the ``model.init_from_hf`` weights once, on the driver, into a state dict the workers load (the run's
    first start; deleted once the run resumes from a checkpoint of its own)."""
    import torch

    from pretrain.export.hf import import_hf

    path = run_dir / layout.INIT_WEIGHTS
    torch.save(import_hf(cfg.model.init_from_hf, max_seq_len=cfg.model.max_seq_len)[1], path)
    return str(path)


def _say(line: str) -> None:
    print(f"[pretrain] {line}", flush=True)
