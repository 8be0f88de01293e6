"""Driver-side preparation of a resume: a run continued from its latest committed checkpoint (``resume RUN_ID``), or
a new run forked from a committed checkpoint (``resume DIR``, or ``train CONFIG checkpoint.resume_from=DIR``).

Every way in makes the same checks before Ray starts and before anything is recorded: the checkpoint is there with
its files' recorded sizes (a damaged one names the newest that verifies), the config may resume it
(:mod:`pretrain.driver.resume_checks`), its data is what the checkpoint trained on, and a step is left to train.
"""

from __future__ import annotations

import dataclasses
import filecmp
import os
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.config import ConfigError, RunConfig, to_dict
from pretrain.config.errors import clip
from pretrain.config.loading import overridden
from pretrain.config.paths import resolve_paths
from pretrain.driver.budget import keep_resolved_budget
from pretrain.driver.prepare import ended_on_error, preflight, prepare_new
from pretrain.driver.run_lock import hold_run
from pretrain.invocation import command
from pretrain.train import tracking
from pretrain.train.job import FINGERPRINT_STATE

if TYPE_CHECKING:
    from pretrain.checkpoint.store import CommittedCheckpoint
    from pretrain.train.job import Job


@dataclasses.dataclass(frozen=True)
class Fork:
    """A new run from a committed checkpoint, checked: the checkpoint, the fingerprint of the data it resumes on,
    and the MLflow tags of a data change the user allowed (``data.allow_changed``)."""

    checkpoint: str
    fingerprint: dict
    data_tags: dict[str, str]


def prepare_resume(target: str, overrides: list[str], hold: ExitStack | None = None) -> Job:
    """Resume from an MLflow run id (its latest committed checkpoint, same run) or from a checkpoint
    or run directory (a new run that records where it came from). ``hold``: where the run's lock is entered before
    anything is read or recorded (a run training in another process is refused), held while it trains; once it is
    held, a checkpoint that an interrupted re-commit of its step set aside is put back
    (:func:`~pretrain.checkpoint.store.restore_superseded`)."""
    from pretrain.checkpoint import latest_committed, layout, resolve, verify_or_point_back
    from pretrain.checkpoint.reader import read_config
    from pretrain.checkpoint.store import restore_superseded
    from pretrain.train.job import Job

    if overridden(overrides, "data", "tokenizer"):  # it would be dropped unseen
        raise ConfigError(
            f"data.tokenizer cannot be given at resume: {target} trains on with its checkpoint's tokenizer (the one "
            f"its weights' ids are of); a model on another tokenizer is a new run"
        )
    uri = tracking.tracking_uri()
    path = Path(target)
    if path.exists():
        ckpt = resolve(path, full=False)
        cfg = resolve_paths(read_config(ckpt, overrides))
        cfg.checkpoint.resume_from = str(ckpt.path)
        cfg.validate(steps_known=True)  # (a budget's steps were derived when the run was created)
        preflight(cfg, grown_at=ckpt.step)
        return prepare_fork(cfg, check_fork(ckpt, cfg), hold)
    root = tracking.run_checkpoint_root(uri, target)
    _check_run_dir_kept(target, root, overrides)
    if hold is not None and root.is_dir():
        hold.enter_context(hold_run(root, target))
        restore_superseded(root)  # no other process writes the run now: a re-commit it interrupted is undone
    latest = latest_committed(root, full=False)
    if latest is None:
        raise ConfigError(f"{target}: run has no committed checkpoint in {root}")
    ckpt = latest
    # Here, before Ray, presence and sizes, and checksums of the small files parsed here (the workers hash what
    # they load, in parallel); a damaged one names the newest that verifies.
    verify_or_point_back(ckpt, full=False)
    cfg = resolve_paths(read_config(ckpt, overrides))
    cfg.checkpoint.dir = str(root.parent)  # where the run is (a relative dir read from another directory is not)
    cfg.data.tokenizer = str(resumed_tokenizer(root, ckpt))
    cfg.validate(steps_known=True)
    preflight(cfg, grown_at=ckpt.step)
    fork = check_fork(ckpt, cfg)
    if cfg.tracking.enabled:
        # one per resume (a later one at another step keeps this one's record)
        tracking.log_config(uri, target, cfg, artifact=f"config/resumed_{layout.step_dir_name(ckpt.step)}.yaml")
        _record_data_change(uri, target, fork)
    return Job(
        config=to_dict(cfg),
        run_id=target,
        run_dir=str(root),
        tracking_uri=uri if cfg.tracking.enabled else "",
        data_fingerprint=fork.fingerprint,
    )


def _check_run_dir_kept(target: str, root: Path, overrides: list[str]) -> None:
    """A run resumed by its id trains on in its own directory ``root``: a ``checkpoint.dir`` given that is not its
    parent would be recorded but not used, and is refused in one line (the one it is, a script passing the same
    directory to every command, changes nothing)."""
    for value in overridden(overrides, "checkpoint", "dir"):
        if Path(str(value)).expanduser().resolve() != root.parent.resolve():
            raise ConfigError(
                f"checkpoint.dir cannot change at resume of run {target}: it trains on in its own directory {root}; "
                f"to train on elsewhere, fork a new run from a checkpoint: {command()} resume CHECKPOINT_DIR "
                "checkpoint.dir=DIR"
            )


def resumed_tokenizer(root: Path, ckpt: CommittedCheckpoint) -> Path:
    """The tokenizer a run resumed by its id trains with: the run directory's own copy (``root / tokenizer``),
    which every save copies into its checkpoint and which, unlike the checkpoint's copy, retention
    (``checkpoint.keep_last``) never deletes. When the run directory has none, ``ckpt``'s copy is copied there first;
    one that differs from ``ckpt``'s is refused in one line."""
    from pretrain.checkpoint import layout
    from pretrain.checkpoint.reader import tokenizer_dir
    from pretrain.checkpoint.store import new_nonce

    own, saved = root / layout.RUN_TOKENIZER, tokenizer_dir(ckpt)
    if not own.exists():
        stage = root / f"{layout.STAGING_PREFIX}{layout.RUN_TOKENIZER}-{new_nonce()}"
        shutil.copytree(saved, stage)
        os.replace(stage, own)  # never a partial copy under the run's tokenizer's name
        return own
    files = [p.relative_to(saved) for p in saved.rglob("*") if p.is_file()]
    if not all((own / f).is_file() and filecmp.cmp(own / f, saved / f, shallow=False) for f in files):
        raise ConfigError(
            f"{own}: not the tokenizer of checkpoint {ckpt.path}, which the run resumes; put back the run's "
            f"tokenizer (a copy of {saved})"
        )
    return own


def check_resume_from(cfg: RunConfig) -> Fork | None:
    """``train CONFIG`` with ``checkpoint.resume_from`` (paths resolved, :func:`preflight` done): the checks
    ``resume DIR`` makes, on the config as given. A run directory stands for its latest committed checkpoint, which
    ``checkpoint.resume_from`` then names; the run trains with the checkpoint's tokenizer (a ``data.tokenizer`` given
    must be that one) and, with ``model.vocab_size`` 0, its vocabulary size; with the checkpoint's budget
    ``train.max_flops``, the steps it was resolved into, and so do the growth points it shares with the checkpoint's
    run (:func:`_resolved_points`). None without ``resume_from``."""
    if not cfg.checkpoint.resume_from:
        return None
    from pretrain.checkpoint import resolve
    from pretrain.checkpoint.reader import read_config, tokenizer_dir

    ckpt = resolve(Path(cfg.checkpoint.resume_from), full=False)
    cfg.checkpoint.resume_from = str(ckpt.path)
    saved = read_config(ckpt)
    own = tokenizer_dir(ckpt)
    if cfg.data.tokenizer:
        _check_same_tokenizer(cfg.data.tokenizer, own, str(ckpt.path))
    else:
        print(f"[pretrain] checkpoint.resume_from: the run trains with the checkpoint's tokenizer ({own})", flush=True)
    cfg.data.tokenizer = str(own)
    if not cfg.model.vocab_size:
        cfg.model.vocab_size = saved.model.vocab_size
    if cfg.train.max_flops and cfg.train.max_flops == saved.train.max_flops:
        cfg.train.max_steps = saved.train.max_steps
    _resolved_points(cfg, saved)
    return check_fork(ckpt, cfg, _as_built(cfg, saved, ckpt.manifest.step))


def _resolved_points(cfg: RunConfig, saved: RunConfig) -> None:
    """Each ``growth.schedule`` entry of ``cfg`` given by ``at_tokens`` or ``at_fraction`` (or no point) that the
    checkpoint's run has too, at the same place in its schedule and otherwise equal, takes the step it was resolved
    to there (the checkpoint's config records it): the config a run was created from forks from its checkpoints as
    it is. Any other such entry stays without a step, and the checks refuse it in one line."""
    for mine, theirs in zip(cfg.growth.schedule, saved.growth.schedule):
        if not mine.at_step and theirs.at_step and dataclasses.replace(mine, at_step=theirs.at_step) == theirs:
            mine.at_step = theirs.at_step


def _as_built(cfg: RunConfig, saved: RunConfig, step: int) -> RunConfig:
    """``cfg`` with the architecture it gives the model at ``step``: after the entries of ``growth.schedule`` before
    it (an entry grows before the step after its ``at_step``, so the checkpoint at that step holds the model before
    the growth; the workers take the checkpoint's architecture, which must be that one). ``model.init_from_hf`` is
    refused: the architecture would be the Hugging Face model's, and the weights the checkpoint's."""
    if cfg.model.init_from_hf:
        raise ConfigError(
            f"model.init_from_hf ({clip(cfg.model.init_from_hf)}) with checkpoint.resume_from: a run that resumes a "
            "checkpoint takes its weights from it; set model.init_from_hf='' with the checkpoint's architecture (its "
            f"config.yaml), or resume it with {command()} resume CHECKPOINT_DIR, which reads that config"
        )
    if not cfg.growth.schedule:
        return cfg
    from pretrain.model.growth_stages import stage_architectures

    grown = sum(1 for entry in cfg.growth.schedule if entry.at_step and entry.at_step < step)
    model, moe = stage_architectures(cfg.model, cfg.moe, cfg.growth.schedule)[grown]
    return dataclasses.replace(cfg, model=model, moe=moe)


def _check_same_tokenizer(given: str, own: Path, checkpoint: str) -> None:
    """A ``data.tokenizer`` given with ``checkpoint.resume_from`` has the checkpoint's vocabulary (every token with
    the same id), or the token ids would mean other text: refused in one line."""
    from tokenizers import Tokenizer

    mine = Path(given) / "tokenizer.json"
    if (
        not mine.is_file()
        or Tokenizer.from_file(str(mine)).get_vocab() != Tokenizer.from_file(str(own / "tokenizer.json")).get_vocab()
    ):
        raise ConfigError(
            f"data.tokenizer: {clip(given)} is not the tokenizer of checkpoint {checkpoint} (another vocabulary), "
            "which the run resumes; leave data.tokenizer unset to train with the checkpoint's"
        )


def check_fork(ckpt: CommittedCheckpoint, cfg: RunConfig, built: RunConfig | None = None) -> Fork:
    """What a resume of ``ckpt`` as ``cfg`` may change (:mod:`pretrain.driver.resume_checks`; one-line refusals
    before anything is recorded; ``built``: ``cfg`` with the architecture the workers build, when it differs) and
    the data it resumes on. ``data.allow_changed`` holds for this resume only."""
    from pretrain.checkpoint.reader import is_full_weights, read_config, read_trainer_state
    from pretrain.data.fingerprint import check_unchanged, differences
    from pretrain.driver.resume_checks import check_resume, check_steps_left

    saved = resolve_paths(read_config(ckpt))
    keep_resolved_budget(saved, cfg)
    check_resume(saved, built or cfg, ckpt.manifest.step, str(ckpt.path), engine_state=not is_full_weights(ckpt))
    state = read_trainer_state(ckpt)
    recorded = (state.get("callbacks") or {}).get(FINGERPRINT_STATE, state.get(FINGERPRINT_STATE))
    current = check_unchanged(recorded, cfg.data, str(ckpt.path))
    changed = differences(recorded, current) if recorded is not None else []
    tags: dict[str, str] = {}
    if changed:
        print(f"[pretrain] warning: data.allow_changed: resuming on changed data: {'; '.join(changed)}", flush=True)
        tags = {"pretrain.data.changed": f"at step {ckpt.manifest.step}: {'; '.join(changed)}"[:4000]}
    cfg.data.allow_changed = False  # this resume's permission, not the run's
    check_steps_left(saved, cfg, ckpt.manifest.step, str(ckpt.path))
    return Fork(str(ckpt.path), current, tags)


def prepare_fork(cfg: RunConfig, fork: Fork, hold: ExitStack | None = None) -> Job:
    """The new run of a checked fork (:func:`prepare_new`), recording the checkpoint it came from
    (``pretrain.resumed_from``) and an allowed data change."""
    job = prepare_new(
        dataclasses.replace(cfg), tags={tracking.TAG_RESUMED_FROM: fork.checkpoint}, checked=True, hold=hold
    )
    if job.tracking_uri:
        with ended_on_error(job.tracking_uri, job.run_id):
            _record_data_change(job.tracking_uri, job.run_id, fork)
    return job


def _record_data_change(uri: str, run_id: str, fork: Fork) -> None:
    if fork.data_tags:
        tracker = tracking.Tracker(uri, run_id)
        tracker.set_tags(fork.data_tags)
        tracker.log_json(fork.fingerprint, "data/fingerprint.json")
