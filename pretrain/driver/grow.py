"""``grow``: a derived run (:mod:`pretrain.driver.derive`) whose model is the parent's grown (the operators of
``pretrain/model/growth.py``, the keys of a ``growth.schedule`` entry), checked on a held-back batch.

    ./launch.sh grow RUN_ID|CHECKPOINT depth=2x width=2x       # depth_op, width_op, heads, ffn, experts, noise
"""

from __future__ import annotations

import dataclasses

import torch

from pretrain.checkpoint.writer import FullWeights
from pretrain.config import ConfigError, RunConfig
from pretrain.driver.derive import derive_run, parse_options, step_option
from pretrain.driver.ui_links import print_run_link
from pretrain.export.checkpoints import LoadedCheckpoint, resolve_checkpoint
from pretrain.invocation import command
from pretrain.train.schedule import resume_overrides
from pretrain.train.tracking import run_ref


def _held_back_batch(parent: LoadedCheckpoint) -> dict[str, torch.Tensor]:
    from pretrain.data import validation_batches

    cfg = parent.config
    batches = validation_batches(
        cfg.data,
        kind=cfg.model.kind,
        seq_len=cfg.model.max_seq_len,
        tokenizer=parent.tokenizer(),
        val_sequences=8,
        micro_batch=8,
        seed=cfg.train.seed,
    )
    if batches:
        return batches[0]
    g = torch.Generator().manual_seed(cfg.train.seed)  # no validation data: a fixed random batch
    ids = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.max_seq_len), generator=g)
    return {"input_ids": ids, "labels": ids}


GROW_KEYS = {"depth", "depth_op", "width", "width_op", "heads", "ffn", "experts", "top_k", "noise", "step", "rewarm"}


def _typed(key: str, value: str) -> object:
    """A grow option's value as its field takes it: whole numbers for ``experts`` and ``top_k``, a number for
    ``noise``, the text for the rest (checked by the growth step's own validation)."""
    try:
        return int(value) if key in ("experts", "top_k") else float(value) if key == "noise" else value
    except ValueError:
        kind = "a whole number" if key in ("experts", "top_k") else "a number"
        raise ConfigError(f"grow {key}: {value!r}: expected {kind}") from None


def _rewarm_steps(cfg: RunConfig, option: str | None) -> int:
    """The child's ``growth.rewarm_steps``: ``rewarm=N``, else the parent's re-warm, else its LR warm-up: a grown
    model starts with fresh AdamW moments, which at the parent's LR make the first updates far too large."""
    if option is None:
        return max(cfg.growth.rewarm_steps, 0) or cfg.train.warmup_steps
    if not (option.isascii() and option.isdigit()):
        raise ConfigError(f"grow rewarm: {option!r}: expected a number of steps (0: continue at the schedule's LR)")
    return int(option)


def grow(argv: list[str]) -> int:
    """``grow RUN_ID|CHECKPOINT [depth=..] [depth_op=..] [width=..] [width_op=..] [heads=..] [ffn=..] [experts=E]
    [top_k=K] [noise=X] [step=N] [rewarm=N]``: a new child run whose first checkpoint is the grown parent; the child
    re-warms its LR over ``growth.rewarm_steps`` (``rewarm``; recorded in its config) from the growth step. Without
    a target it stacks the depth 4x (G_stack's published growth factor)."""
    from pretrain.config import GrowthStep
    from pretrain.config.loading import build_section
    from pretrain.config.tree import MAX_SIZE
    from pretrain.driver.budget import check_grown_sizes
    from pretrain.model.growth import apply_growth, count_parameters
    from pretrain.model.layerdrop import as_of
    from pretrain.train.callbacks.growth import check_growth_loss, grown_config, held_back_loss

    opts = parse_options(argv, GROW_KEYS, "grow")
    step, rewarm_opt = step_option(opts, "grow"), opts.pop("rewarm", None)
    opts.pop("step", None)
    typed = {k: _typed(k, v) for k, v in opts.items()}
    entry = build_section(GrowthStep, typed, "grow")
    entry.check("grow", MAX_SIZE["moe.num_experts"])  # as a growth.schedule entry is checked
    if not set(typed) & {*GrowthStep.TARGETS, "experts"}:
        print("[grow] no target given: depth=4x depth_op=stack (the default: G_stack's growth factor)")
    parent = resolve_checkpoint(argv[0], step)
    cfg = parent.config
    check_grown_sizes(cfg.model, entry, "grow")  # before growth copies blocks: a typo must not fill the memory
    sd = parent.state_dict(inference=False)
    trained = as_of(cfg.layer_drop, parent.ckpt.step - 1)  # the layer dropout of the parent's steps trained
    try:
        grown = apply_growth(cfg.model, cfg.moe, sd, entry, seed=cfg.train.seed + parent.ckpt.step, layer_drop=trained)
    except ValueError as e:
        raise ConfigError(f"grow: {e}") from None
    new_cfg = grown_config(cfg, grown.model, grown.moe)
    rewarm = _rewarm_steps(cfg, rewarm_opt)
    new_cfg = dataclasses.replace(
        new_cfg, name=f"{cfg.name}-grown", growth=dataclasses.replace(new_cfg.growth, rewarm_steps=rewarm)
    )
    batch, cpu = [_held_back_batch(parent)], torch.device("cpu")
    before = held_back_loss(dataclasses.replace(cfg, layer_drop=trained), sd, batch, cpu)
    after = held_back_loss(dataclasses.replace(new_cfg, layer_drop=trained), grown.state, batch, cpu)
    rel = check_growth_loss(
        before,
        after,
        exact=grown.exact and entry.noise == 0,
        tolerance=cfg.growth.check_tolerance,
        operator=grown.operator,
        at_step=parent.ckpt.step,
    )
    print(f"[grow] {grown.operator}: held-back loss (fp32) {before:.5f} -> {after:.5f} (relative change {rel:.1e})")
    if entry.experts and entry.noise == 0:
        print(
            "[grow] warning: noise=0 upcycles into identical experts behind a zero router: training never tells them "
            "apart (every token picks the same ones); an exactness check only, train with noise > 0 (default 1e-3)"
        )
    run_id, path = derive_run(
        parent,
        new_cfg,
        FullWeights(grown.state),
        {
            "growth.parent_run_id": parent.run_id or "",
            "growth.parent_step": parent.ckpt.step,
            "growth.operator": grown.operator,
        },
        "growth",
        metrics={"growth/loss_before": before, "growth/loss_after": after},
        grown=True,
    )
    params = count_parameters(grown.state, grown.model.tie_embeddings)
    print(
        f"[grow] new run {run_id}: {new_cfg.model.num_layers} blocks, hidden {new_cfg.model.hidden_size}, "
        f"{new_cfg.moe.num_experts or 'no'} experts, {params:,} parameters; checkpoint {path}"
    )
    if rewarm:
        print(
            f"[grow] the new run starts with fresh AdamW moments and re-warms its LR from 0 over {rewarm} steps "
            f"after step {parent.ckpt.step} (growth.rewarm_steps; rewarm=N to change, 0 to continue)"
        )
    ref, longer = run_ref(run_id, path.parent), resume_overrides(new_cfg.train, parent.ckpt.step)
    print(
        f"  resume:  {command()} resume {ref}{' ' + longer if longer else ''}\n"
        f"  export:  {command()} export {ref} --out exported/{run_id}"
    )
    print_run_link(new_cfg.tracking.enabled, run_id)
    return 0
