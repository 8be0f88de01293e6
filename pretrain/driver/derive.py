"""Derived runs: a new MLflow run (a child of its parent's) whose first committed checkpoint is a transformed copy of
a parent checkpoint — the parent's weights reshaped, its data position and counters carried over — so the new run
evaluates, resumes and exports like any other. ``prune`` keeps a subset of the blocks; ``grow`` grows the model
(the operators of ``pretrain/model/growth.py``, the keys of a ``growth.schedule`` entry).

    ./launch.sh prune RUN_ID|CHECKPOINT layers=every_other [scale=train]   # or layers=first:4, layers=[0,2,5]
    ./launch.sh grow RUN_ID|CHECKPOINT depth=2x width=2x       # depth_op, width_op, heads, ffn, experts, noise

The checkpoint is written by this process through the checkpoint layer's writer, as full weights (no DeepSpeed engine on
the driver; without optimizer moments the resumed run starts a fresh optimizer state, the reshaped model has other
parameters); it resumes on any worker count and expert layout. ``anneal`` (pretrain/driver/anneal.py) keeps the model,
so its child carries the parent's engine state, AdamW moments included.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint import reader
from pretrain.checkpoint import weights as ckpt_weights
from pretrain.checkpoint.writer import CheckpointWriter, Contents, EngineState, FullWeights, LocalWorld
from pretrain.config import ConfigError, RunConfig
from pretrain.config.paths import resolve_paths
from pretrain.data.fingerprint import fingerprints
from pretrain.driver.prepare import create_run
from pretrain.export.checkpoints import LoadedCheckpoint, resolve_checkpoint
from pretrain.model.layerdrop import fold_branch_scales, inference_scales, layer_rates, select_blocks
from pretrain.train import tracking
from pretrain.train.job import FINGERPRINT_STATE

StateDict = dict[str, torch.Tensor]


def derive_run(
    parent: LoadedCheckpoint,
    cfg: RunConfig,
    model: FullWeights | EngineState,
    tags: dict[str, Any],
    what: str,
    metrics: dict[str, float] | None = None,
    grown: bool = False,
    data: dict | None = None,
) -> tuple[str, Path]:
    """Write ``model`` as the first checkpoint of a new run, child of the parent's run, continuing the parent's
    step, tokens and data position: full weights of ``cfg.model`` (and, when given, AdamW moments of those weights
    by name, see ``pretrain/checkpoint/weights.py``), written here without an engine and resumed on any worker count
    and expert layout; or the parent's own engine state (:func:`parent_engine_state`: the model is unchanged), then
    recorded as written by the parent's worker count. ``grown``: the checkpoint records a growth at the parent's
    step, so the resumed run re-warms its LR over ``growth.rewarm_steps`` from there (the growth callback's state,
    as after an in-job growth). ``data``: another data position than the parent's (e.g. fresh streams of another
    mixture). Returns (run id, path)."""
    cfg = resolve_paths(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume_from="")))
    cfg.data.tokenizer = str(parent.tokenizer_dir())
    all_tags = {
        **{k: str(v) for k, v in tags.items()},
        "pretrain.derived": what,
        "pretrain.parent_checkpoint": str(parent.ckpt.path),
    }
    if parent.run_id:
        all_tags["mlflow.parentRunId"] = parent.run_id  # the MLflow UI nests the child under its parent
    run_id, run_dir, uri = create_run(cfg, all_tags)
    tracker = tracking.Tracker(uri, run_id)
    if metrics:
        tracker.log_metrics(metrics, parent.ckpt.step)
    raw = parent.trainer_state()
    state: dict[str, Any] = {
        "step": int(raw.get("step", parent.ckpt.step)),
        "tokens_seen": int(raw.get("tokens_seen", 0)),
        "sequences": int(raw.get("sequences", 0)),
        "last_train_loss": float("nan"),
    }
    # the data the child trains on (a resume of the child compares its sources with it)
    state["callbacks"] = {FINGERPRINT_STATE: fingerprints(cfg.data)}
    if grown:  # the parent's applied schedule entries stay applied; the growth happened at this step
        applied = (raw.get("callbacks") or {}).get("growth", {}).get("applied", [])
        state["callbacks"]["growth"] = {"applied": applied, "last_growth_step": state["step"]}
    world = LocalWorld()
    if isinstance(model, EngineState):  # one process writes the state of the parent's ranks
        world.world_size = parent.ckpt.manifest.world_size
    writer = CheckpointWriter(
        run_dir, world, run_id, keep_last=cfg.checkpoint.keep_last, register=tracker.register_checkpoint
    )
    data_state = data if data is not None else parent.data_position()
    rng = reader.read_rng_state(parent.ckpt.path, 0) or {"torch": torch.get_rng_state()}
    path = writer.save(Contents(cfg=cfg, trainer_state=state, data_state=data_state, model=model, rng_state=rng))
    tracker.finish("FINISHED")
    return run_id, path


def parent_engine_state(parent: LoadedCheckpoint) -> EngineState | FullWeights:
    """The parent's model state unchanged, optimizer state included, for a child of the same model (``anneal``):
    its DeepSpeed engine files hard-linked (a committed checkpoint is never modified; copied where the filesystem
    cannot link), or its full weights with their AdamW moments."""
    if reader.is_full_weights(parent.ckpt):
        return FullWeights(
            ckpt_weights.load_full_weights(parent.ckpt.path), ckpt_weights.load_optimizer_moments(parent.ckpt.path)
        )
    src = ckpt_weights.ds_engine_dir(parent.ckpt.path)

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    def save(directory: Path, on_file=None) -> list[Path]:  # the writer hashes the returned files
        shutil.copytree(src, directory, copy_function=link, dirs_exist_ok=True)
        return [p for p in directory.rglob("*") if p.is_file()]

    return EngineState(save)


def pruned(parent: LoadedCheckpoint, keep: list[int], scale: str = "inference") -> tuple[RunConfig, StateDict]:
    """The parent's config and weights with only blocks ``keep`` (see :func:`prune_blocks`)."""
    return prune_blocks(parent.config, parent.state_dict(inference=False), keep, scale)


PRUNE_SCALES = ("inference", "train")


def prune_blocks(
    cfg: RunConfig, sd: StateDict, keep: list[int], scale: str = "inference"
) -> tuple[RunConfig, StateDict]:
    """The config and weights of ``cfg``'s model (training weights ``sd``) with only blocks ``keep``, renumbered
    0..len(keep)-1: the pruned model's forward is the parent's inference forward with the other blocks skipped.

    Layer dropout with ``scaling: rho``: each kept block's inference scale is rho of its depth in the *parent*
    (``by_depth: linear`` gives the child's depth other rates), so the parent's scales of the kept blocks are
    folded into their weights and the child is written with ``scaling: inverted``, which applies nothing at
    inference. The rest of ``layer_drop`` is kept: a resumed child goes on dropping layers (inverted: kept
    branches x 1/rho in training), the parent's own training forward again wherever the child's rate of a block
    equals the parent's (``by_depth: uniform``); the fold makes the two parametrizations agree.

    ``scale="train"``: each kept block keeps the scale it ran at in training when it was kept (``inverted``: 1/rho
    of its rate, folded into its weights; ``rho``: none), the forward a layer-dropout run trained while about
    ``1 - rate`` of its blocks ran: what pruning to that depth keeps (LayerDrop's pruning, Fan et al. 2019,
    arXiv:1909.11556). The same as ``inference`` without layer dropout.
    """
    if scale not in PRUNE_SCALES:
        raise ConfigError(f"prune scale: {scale!r}: expected one of {', '.join(PRUNE_SCALES)}")
    scales = inference_scales(cfg.layer_drop, cfg.model.num_layers)
    if scale == "train":
        rates = layer_rates(cfg.layer_drop, cfg.model.num_layers, cfg.layer_drop.rate)
        inverted = cfg.layer_drop.enabled and cfg.layer_drop.scaling == "inverted"
        scales = [(1.0 / (1.0 - r), 1.0 / (1.0 - r)) for r in rates] if inverted else None
    layer_drop = cfg.layer_drop
    if scales is not None:
        sd = fold_branch_scales(sd, cfg.model.norm_placement, scales)
    if cfg.layer_drop.enabled:  # whatever was folded, the child's inference applies nothing more
        layer_drop = dataclasses.replace(layer_drop, scaling="inverted")
    new_index = {old: new for new, old in enumerate(keep)}
    out: StateDict = {}
    for key, value in sd.items():
        if key.startswith("blocks."):
            _, old, rest = key.split(".", 2)
            if int(old) not in new_index:
                continue
            key = f"blocks.{new_index[int(old)]}.{rest}"
        out[key] = value
    model = dataclasses.replace(cfg.model, num_layers=len(keep))
    moe = cfg.moe
    if moe.enabled:
        moe_blocks = [new_index[i] for i in keep if moe.is_moe_layer(i)]
        if not moe_blocks:
            moe = dataclasses.replace(moe, num_experts=0, layers=[])
        else:
            moe = dataclasses.replace(moe, layers=moe_blocks, every=1)
    new = dataclasses.replace(cfg, model=model, moe=moe, layer_drop=layer_drop, name=f"{cfg.name}-pruned{len(keep)}")
    return new, out


def prune(argv: list[str]) -> int:
    """``prune RUN_ID|CHECKPOINT layers=SPEC [step=N] [scale=inference|train]``."""
    opts = _options(argv, {"layers", "step", "scale"}, "prune")
    parent = resolve_checkpoint(argv[0], int(opts["step"]) if "step" in opts else None)
    try:
        keep = select_blocks(opts.get("layers", "every_other"), parent.config.model.num_layers)
    except ValueError as e:
        raise ConfigError(f"prune layers: {e}") from None
    scale = opts.get("scale", "inference")
    cfg, weights = pruned(parent, keep, scale)
    run_id, path = derive_run(
        parent,
        cfg,
        FullWeights(weights),
        {
            "prune.parent_run_id": parent.run_id or "",
            "prune.parent_step": parent.ckpt.step,
            "prune.layers": ",".join(map(str, keep)),
            "prune.scale": scale,
        },
        "prune",
    )
    print(f"[prune] kept blocks {keep} of {parent.config.model.num_layers} from {parent.ckpt.path}")
    ld = parent.config.layer_drop
    if scale == "train" and ld.enabled:
        what = "1/rho of their rates folded into their weights" if ld.scaling == "inverted" else "no scale (rho unused)"
        print(f"[prune] scale=train: the kept blocks run as they trained when kept: {what}")
    elif cfg.layer_drop.scaling != ld.scaling:
        print(
            "[prune] layer_drop.scaling rho: the parent's rho of the kept blocks is folded into their weights; "
            "the new run uses layer_drop.scaling=inverted (nothing to apply at inference)"
        )
    if cfg.model.norm_placement == "deepnorm":
        print(
            "[prune] note: deepnorm's residual weight alpha = (2 * num_layers) ** 0.25 follows the depth, so the "
            "pruned model is not exactly the parent with the other blocks skipped"
        )
    print(f"[prune] new run {run_id}: checkpoint {path}")
    print(
        f"  eval:    ./launch.sh eval {run_id}\n  resume:  ./launch.sh resume {run_id} "
        f"train.max_steps={parent.ckpt.step * 2}\n  export:  ./launch.sh export {run_id} --out exported/{run_id}"
    )
    return 0


def _options(argv: list[str], valid: set[str], usage: str) -> dict[str, str]:
    if not argv or "=" in argv[0]:
        raise ConfigError(f"{usage}: give a run id or a checkpoint directory first")
    opts = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    unknown = sorted(set(opts) - valid)
    if unknown or len(opts) != len(argv) - 1:
        raise ConfigError(f"{usage}: unknown option(s) {unknown or argv[1:]} (valid: {', '.join(sorted(valid))})")
    return opts


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


def _rewarm_steps(cfg: RunConfig, option: str | None) -> int:
    """The child's ``growth.rewarm_steps``: ``rewarm=N``, else the parent's re-warm, else its LR warm-up: a grown
    model starts with fresh AdamW moments, which at the parent's LR make the first updates far too large."""
    if option is None:
        return max(cfg.growth.rewarm_steps, 0) or cfg.train.warmup_steps
    if not option.isdigit():
        raise ConfigError(f"grow rewarm: {option!r}: expected a number of steps (0: continue at the schedule's LR)")
    return int(option)


def grow(argv: list[str]) -> int:
    """``grow RUN_ID|CHECKPOINT [depth=..] [depth_op=..] [width=..] [width_op=..] [heads=..] [ffn=..] [experts=E]
    [top_k=K] [noise=X] [step=N] [rewarm=N]``: a new child run whose first checkpoint is the grown parent; the child
    re-warms its LR over ``growth.rewarm_steps`` (``rewarm``; recorded in its config) from the growth step. Without
    a target it stacks the depth 4x (the growth study's recipe)."""
    from pretrain.config import GrowthStep
    from pretrain.config.loading import build_section
    from pretrain.model.growth import apply_growth, count_parameters
    from pretrain.train.callbacks.growth import check_growth_loss, grown_config, held_back_loss

    opts = _options(argv, GROW_KEYS, "grow")
    step_opt, rewarm_opt = opts.pop("step", None), opts.pop("rewarm", None)
    typed = {k: (int(v) if k in ("experts", "top_k") else float(v) if k == "noise" else v) for k, v in opts.items()}
    entry = build_section(GrowthStep, typed, "grow")
    if not set(typed) & {*GrowthStep.TARGETS, "experts"}:
        print("[grow] no target given: depth=4x depth_op=stack (the default, the growth study's recipe)")
    parent = resolve_checkpoint(argv[0], int(step_opt) if step_opt else None)
    cfg = parent.config
    sd = parent.state_dict(inference=False)
    try:
        grown = apply_growth(
            cfg.model, cfg.moe, sd, entry, seed=cfg.train.seed + parent.ckpt.step, layer_drop=cfg.layer_drop
        )
    except ValueError as e:
        raise ConfigError(f"grow: {e}") from None
    new_cfg = grown_config(cfg, grown.model, grown.moe)
    rewarm = _rewarm_steps(cfg, rewarm_opt)
    new_cfg = dataclasses.replace(
        new_cfg, name=f"{cfg.name}-grown", growth=dataclasses.replace(new_cfg.growth, rewarm_steps=rewarm)
    )
    batch, cpu = [_held_back_batch(parent)], torch.device("cpu")
    before, after = held_back_loss(cfg, sd, batch, cpu), held_back_loss(new_cfg, grown.state, batch, cpu)
    rel = check_growth_loss(
        before,
        after,
        exact=grown.exact and entry.noise == 0,
        tolerance=cfg.growth.check_tolerance,
        operator=grown.operator,
        at_step=parent.ckpt.step,
    )
    print(f"[grow] {grown.operator}: held-back loss (fp32) {before:.5f} -> {after:.5f} (relative change {rel:.1e})")
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
    print(
        f"  resume:  ./launch.sh resume {run_id} train.max_steps={parent.ckpt.step * 2}\n"
        f"  export:  ./launch.sh export {run_id} --out exported/{run_id}"
    )
    return 0
