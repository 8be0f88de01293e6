"""Annealing a warmup-stable-decay run: a child run that decays the LR from a checkpoint's value to the floor.

    ./launch.sh anneal RUN_ID|CHECKPOINT steps=N [step=S] [key=value ...]

The child (``pretrain.derived: anneal``, an MLflow child of the parent run) starts from the parent's weights at step S
and trains N more steps with ``train.decay: wsd`` whose decay phase is exactly those N steps: the LR goes from the
checkpoint's LR (the parent's LR of its step S, the last step it trained) down to the parent's floor ``lr *
min_lr_ratio`` in ``train.decay_shape``. ``key=value`` overrides the child's config (e.g. another data mixture:
``data.sources=[...]``; a change of what the training streams are (:data:`STREAM_FIELDS`) starts fresh streams of the
new mixture, otherwise the parent's data position is carried on). Written through the derived-run path of
``grow``/``prune``, but with the parent's model and optimizer state unchanged (AdamW moments and step included): the
child continues the parent's optimization exactly, only the LR schedule differs (so the model, MoE and ZeRO sections
cannot be overridden). The child resumes (``./launch.sh resume CHILD``), evaluates and exports like any run.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from pretrain.config import ConfigError, RunConfig, load_config, make_plan, to_dict
from pretrain.config.loading import INT_MAX
from pretrain.driver.derive import derive_run, once_each, parent_engine_state, step_option
from pretrain.driver.ui_links import print_run_link
from pretrain.export.checkpoints import LoadedCheckpoint, resolve_checkpoint
from pretrain.invocation import command
from pretrain.train.schedule import lr_at
from pretrain.train.tracking import run_ref

USAGE = "anneal RUN_ID|CHECKPOINT steps=N [step=S] [key=value ...]"
FIXED = ("model", "moe", "zero")
"""Config sections an anneal keeps: its child loads the parent's engine state as it is."""
SCHEDULED = ("max_steps", "warmup_steps", "decay", "decay_steps")
"""``train`` fields an anneal sets itself (from ``steps=N`` and the checkpoint's step): an override of one is
refused, never replaced unseen."""


def annealed_config(parent: RunConfig, at_step: int, steps: int, overrides: Sequence[str] = ()) -> RunConfig:
    """The child's config: ``parent`` with ``overrides``, then a WSD schedule whose decay phase is the ``steps``
    steps after ``at_step``, from the checkpoint's LR (of the parent's last step, 0-based ``at_step - 1``) down to
    the (overridden) floor: annealed where the parent's own WSD decay starts, the child's LRs are the parent's."""
    cfg = load_config(None, list(overrides), base=to_dict(parent))
    fixed = [k for k in FIXED if to_dict(getattr(cfg, k)) != to_dict(getattr(parent, k))]
    if fixed:
        raise ConfigError(
            f"anneal: {', '.join(fixed)} cannot change (the child continues the parent's model and "
            f"optimizer state); got {' '.join(overrides)}"
        )
    scheduled = [f"train.{k}" for k in SCHEDULED if getattr(cfg.train, k) != getattr(parent.train, k)]
    if scheduled:
        raise ConfigError(
            f"anneal: {', '.join(scheduled)} cannot be given: the child's schedule is a decay over steps=N from the "
            "checkpoint's step (train.lr and train.min_lr_ratio set its floor)"
        )
    if at_step + steps > INT_MAX:
        raise ConfigError(f"anneal: steps={steps}: step {at_step} + {steps} is out of range (at most {INT_MAX})")
    start = lr_at(max(at_step - 1, 0), parent.train)
    if start <= 0:
        raise ConfigError(
            f"anneal: the parent's LR at step {at_step} is 0 (its schedule has decayed to a floor of 0): there is "
            "nothing to anneal from; give a checkpoint before its decay with step=S"
        )
    floor = cfg.train.lr * cfg.train.min_lr_ratio
    train = dataclasses.replace(
        cfg.train,
        decay="wsd",
        decay_steps=steps,
        max_steps=at_step + steps,
        warmup_steps=0,
        lr=start,
        min_lr_ratio=min(1.0, floor / start),
    )
    name = cfg.name if cfg.name != parent.name else f"{parent.name}-anneal{at_step}"  # a name=... given is kept
    return dataclasses.replace(cfg, train=train, name=name).validate(steps_known=True)


def fresh_data_position(cfg: RunConfig, parent: LoadedCheckpoint) -> dict:
    """Fresh streams of the child's (changed) data config, as the first checkpoint's data position."""
    from pretrain.data.batches import TrainBatches

    return TrainBatches(
        cfg.data, kind=cfg.model.kind, tokenizer=parent.tokenizer(), plan=make_plan(cfg, 1), rank=0, seed=cfg.train.seed
    ).state_dict()


STREAM_FIELDS = ("sources", "val_sources", "val_holdout", "num_streams", "repeat", "shuffle_sequences", "piece_chars")
"""The ``data`` fields that define the training streams (what the data position is a position in); the others
(``bad_records``, ``mlm_probability``, ``cache_dir``...) leave the parent's position valid."""


def _stream(cfg: RunConfig) -> dict:
    data = to_dict(cfg.data)
    return {k: data[k] for k in STREAM_FIELDS}


def anneal(argv: list[str]) -> int:
    """``anneal RUN_ID|CHECKPOINT steps=N [step=S] [key=value ...]``: a new child run annealing the parent."""
    if not argv or "=" in argv[0]:
        raise ConfigError(f"{USAGE}: give a run id or a checkpoint directory first")
    options = {"steps", "step"}  # every other key=value is a config override (train.lr=.., data={..}, name=..)
    opts = once_each(
        [a.split("=", 1) for a in argv[1:] if "=" in a and a.split("=", 1)[0].strip() in options], "anneal"
    )
    overrides = [a for a in argv[1:] if "=" in a and a.split("=", 1)[0].strip() not in options]
    sections = {f.name for f in dataclasses.fields(RunConfig)}
    bad = [a for a in argv[1:] if "=" not in a] + [
        key for a in overrides if (key := re.split(r"[.\[]", a.split("=", 1)[0].strip())[0]) not in sections
    ]
    if bad:
        raise ConfigError(f"anneal: unknown option(s) {bad} (valid: steps=N, step=S, config overrides key=value)")
    given = opts.get("steps", "")
    if not (given.isascii() and given.isdigit()) or int(given) <= 0:
        raise ConfigError(f"anneal: steps=N (the length of the decay, > 0) is required, got {opts.get('steps')!r}")
    steps = int(given)
    parent = resolve_checkpoint(argv[0], step_option(opts, "anneal"))
    at = parent.ckpt.step
    cfg = annealed_config(parent.config, at, steps, overrides)
    data = fresh_data_position(cfg, parent) if _stream(cfg) != _stream(parent.config) else None
    run_id, path = derive_run(
        parent,
        cfg,
        parent_engine_state(parent),
        {
            "anneal.parent_run_id": parent.run_id or "",
            "anneal.parent_step": at,
            "anneal.steps": steps,
            "anneal.shape": cfg.train.decay_shape,
            "anneal.overrides": " ".join(overrides),
        },
        "anneal",
        data=data,
    )
    t = cfg.train
    print(
        f"[anneal] from {parent.ckpt.path} (step {at}): LR {t.lr:.3g} -> {t.lr * t.min_lr_ratio:.3g} over "
        f"{steps} steps ({t.decay_shape}){'; fresh streams of the new data mixture' if data else ''}"
    )
    print(f"[anneal] new run {run_id}: checkpoint {path} (the parent's weights and optimizer state)")
    cmd, ref = command(), run_ref(run_id, path.parent)
    print(
        f"  train:   {cmd} resume {ref}\n  eval:    {cmd} eval {ref}\n"
        f"  export:  {cmd} export {ref} --out exported/{run_id}"
    )
    print_run_link(cfg.tracking.enabled, run_id)
    return 0
