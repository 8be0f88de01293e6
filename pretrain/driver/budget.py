"""A run's FLOPs budget (``train.max_flops``) and growth points given in tokens or as a fraction of the budget
(``growth.schedule[i].at_tokens`` / ``at_fraction``), resolved into steps when the run is created or resumed,
each growth stage counted at its own FLOPs per token (:mod:`pretrain.model.growth_stages`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from pretrain.config import GrowthStep, ModelConfig, MoEConfig, RunConfig, make_plan
from pretrain.config.errors import ConfigError
from pretrain.config.loading import INT_MAX
from pretrain.config.tree import BYTE_LEVEL_VOCAB, MAX_SIZE


def growth_stages(cfg: RunConfig, first: int = 0) -> list[tuple[ModelConfig, MoEConfig]]:
    """The architecture before the first growth of ``growth.schedule`` (from its entry ``first`` on) and after
    each, built as :func:`pretrain.model.growth_stages.stage_architectures` builds them (weightless). An entry that
    cannot grow the model it is applied to (a ``tile`` factor that is not whole, a smaller depth, an MoE model
    upcycled again...) is refused with a :class:`ConfigError` naming the entry."""
    from pretrain.model.growth_stages import grown_architecture

    stages = [(cfg.model, cfg.moe)]
    for i, entry in enumerate(cfg.growth.schedule[first:], start=first):
        try:
            check_grown_sizes(stages[-1][0], entry, f"growth.schedule[{i}]")
            stages.append(grown_architecture(*stages[-1], entry))
        except ConfigError:
            raise  # (a ValueError too) already naming the entry
        except ValueError as e:
            raise ConfigError(f"growth.schedule[{i}]: {e}") from None
    return stages


def check_grown_sizes(model: ModelConfig, entry: GrowthStep, where: str) -> None:
    """The sizes ``entry`` grows ``model`` to are within :data:`~pretrain.config.tree.MAX_SIZE` (checked before the
    growth is applied, which takes time in the number of blocks)."""
    from pretrain.model.growth import resolve_count
    from pretrain.model.transformer import resolved_ffn_size

    head_dim = model.hidden_size // model.num_heads
    for name, key, current, unit in (
        ("depth", "model.num_layers", model.num_layers, 1),
        ("width", "model.hidden_size", model.hidden_size, 1),
        ("heads", "model.hidden_size", model.num_heads, head_dim),
        ("ffn", "model.ffn_size", resolved_ffn_size(model), 1),
    ):
        spec = str(getattr(entry, name))
        size = resolve_count(spec, current) * unit if spec else 0
        if size > MAX_SIZE[key]:
            raise ConfigError(f"{where}.{name}: {spec} grows {key} to {size:,}, more than {MAX_SIZE[key]:,}")


def check_growth_stages(cfg: RunConfig, grown_at: int = 0) -> None:
    """Every entry of ``growth.schedule`` applies to the model before it (:func:`growth_stages`), and the config of
    the model it grows to passes the checks the job makes at that growth (the parallel degrees against its heads,
    experts and MoE), checked before a run is recorded; a vocabulary size still to be taken from the tokenizer (0)
    is stood in for, as growth never changes it. ``grown_at``: the step of the checkpoint whose stored config this
    is, whose model the entries before that step have grown already (a checkpoint at an entry's ``at_step`` is
    the model before it): only the later entries are applied."""
    done = sum(1 for e in cfg.growth.schedule if e.at_step < grown_at) if grown_at else 0
    if done == len(cfg.growth.schedule):
        return
    from pretrain.train.callbacks.growth import grown_config

    model = cfg.model if cfg.model.vocab_size > 0 else dataclasses.replace(cfg.model, vocab_size=BYTE_LEVEL_VOCAB)
    cfg = dataclasses.replace(cfg, model=model)
    for i, (grown, moe) in enumerate(growth_stages(cfg, done)[1:], start=done):
        try:  # the checks the job makes at the growth (parallelism against the grown model: heads, MoE, experts)
            grown_config(cfg, grown, moe)
        except ConfigError as e:
            raise ConfigError(f"growth.schedule[{i}]: the model it grows to: {e}") from None


def stage_flops_per_step(cfg: RunConfig) -> list[float]:
    """Training FLOPs of one optimizer step before the first growth of ``growth.schedule`` and after each."""
    from pretrain.model import flops_per_token

    plan = make_plan(cfg, cfg.cluster.num_workers)
    stages = growth_stages(cfg)
    return [flops_per_token(m, plan.seq_len, moe) * plan.tokens_per_step for m, moe in stages]


def run_flops(cfg: RunConfig, steps: int | None = None) -> float:
    """Training FLOPs of the first ``steps`` steps (default ``train.max_steps``), growths included."""
    per_step = stage_flops_per_step(cfg)
    steps = cfg.train.max_steps if steps is None else steps
    edges = [0, *(e.at_step for e in cfg.growth.schedule), steps]
    return sum(f * max(0, min(b, steps) - min(a, steps)) for f, a, b in zip(per_step, edges, edges[1:]))


def resolve_budget(cfg: RunConfig, say: Callable[[str], None] = print, announce: bool = False) -> RunConfig:
    """Sets (in place) each growth's ``at_step`` from its ``at_tokens`` or ``at_fraction``, then ``train.max_steps``
    from ``train.max_flops``; one line for each value it changes (``announce``: each value it derives, for a new
    run). Idempotent, so a resumed run derives the same steps (and says nothing). A no-op for a run that uses none
    of them."""
    t, schedule = cfg.train, cfg.growth.schedule
    if not t.max_flops and not any(e.derived_step for e in schedule):
        return cfg
    per_step = stage_flops_per_step(cfg)  # growth points do not change the architectures, only when they come
    plan = make_plan(cfg, cfg.cluster.num_workers)
    spent, step = 0.0, 0
    for i, entry in enumerate(schedule):
        where, before, fraction = f"growth.schedule[{i}]", entry.at_step, entry.fraction
        if entry.at_tokens:
            entry.at_step = math.ceil(entry.at_tokens / plan.tokens_per_step)
        elif fraction:
            goal = fraction * t.max_flops
            if i and goal <= spent:
                raise ConfigError(
                    f"{where}: {'' if entry.at_fraction else 'the default point, '}at_fraction {fraction:g} of "
                    f"train.max_flops is spent by step {step}, where "
                    f"growth.schedule[{i - 1}] grows; the growths must come in order, each at a later point"
                )
            entry.at_step = step + max(1, math.ceil((goal - spent) / per_step[i] - 1e-9))
        changed = announce or entry.at_step != before
        if changed and entry.at_tokens:
            say(
                f"{where}: at_tokens {entry.at_tokens:,} -> at_step {entry.at_step} "
                f"({plan.tokens_per_step:,} tokens/step)"
            )
        elif changed and fraction:
            default = "" if entry.at_fraction else " (the default point)"
            say(
                f"{where}: at_fraction {fraction:g}{default} of train.max_flops {t.max_flops:.4g} -> "
                f"at_step {entry.at_step}"
            )
        if entry.at_step <= step:
            raise ConfigError(f"{where}: at step {entry.at_step}, not after the growth before it (step {step})")
        spent += (entry.at_step - step) * per_step[i]
        step = entry.at_step
    if t.max_flops:
        if spent >= t.max_flops:
            raise ConfigError(
                f"train.max_flops: {t.max_flops:.4g} is spent before the last growth (step {step}, {spent:.4g} FLOPs)"
            )
        before, t.max_steps = t.max_steps, step + math.ceil((t.max_flops - spent) / per_step[-1] - 1e-9)
        if t.max_steps > INT_MAX:
            raise ConfigError(
                f"train.max_flops: {t.max_flops:.4g} is {t.max_steps:.4g} steps of {per_step[-1]:.4g} FLOPs, more than "
                f"{INT_MAX:,} (int64)"
            )
        if announce or t.max_steps != before:
            say(
                f"train.max_flops {t.max_flops:.4g} -> train.max_steps {t.max_steps} "
                f"({per_step[-1]:.4g} FLOPs/step{' after the last growth' if schedule else ''})"
            )
        from pretrain.train.schedule import schedule_warning  # (the command's own waits for these steps)

        if announce and (warning := schedule_warning(t)):
            say(warning)
    return cfg.validate(steps_known=True)


def keep_resolved_budget(saved: RunConfig, cfg: RunConfig) -> None:
    """A resumed run keeps the steps derived when it was created: its checkpoint records the architecture of its
    step (a grown one after a growth), so they cannot be derived again. Refuses, in one line, a new budget or a
    growth point that would need deriving."""
    if cfg.train.max_flops and cfg.train.max_flops != saved.train.max_flops:
        raise ConfigError(
            f"train.max_flops: {saved.train.max_flops:.4g} -> {cfg.train.max_flops:.4g}: a budget is resolved into "
            f"train.max_steps ({saved.train.max_steps}) when the run is created; to train on, resume with "
            "train.max_flops=0 and train.max_steps=N"
        )
    for i, entry in enumerate(cfg.growth.schedule):
        if not entry.at_step:
            raise ConfigError(
                f"growth.schedule[{i}]: a growth added on resume needs its point as at_step (at_tokens and "
                "at_fraction are resolved when a run is created)"
            )
