"""``prune``: a derived run (:mod:`pretrain.driver.derive`) whose model keeps a subset of the parent's blocks.

./launch.sh prune RUN_ID|CHECKPOINT layers=every_other [scale=train]   # or layers=first:4, layers=[0,2,5]
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
from pretrain.model.layerdrop import as_of, fold_branch_scales, inference_scales, layer_rates, select_blocks
from pretrain.train.schedule import resume_overrides
from pretrain.train.tracking import run_ref

StateDict = dict[str, torch.Tensor]


def pruned(parent: LoadedCheckpoint, keep: list[int], scale: str = "inference") -> tuple[RunConfig, StateDict]:
    """The parent's config and weights with only blocks ``keep`` (see :func:`prune_blocks`)."""
    return prune_blocks(parent.config, parent.state_dict(inference=False), keep, scale, parent.ckpt.step)


PRUNE_SCALES = ("inference", "train")


def prune_blocks(
    cfg: RunConfig, sd: StateDict, keep: list[int], scale: str = "inference", trained_steps: int | None = None
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

    Early exits listed by depth (``layer_drop.early_exit.layers``) as deep as the pruned model or deeper are dropped
    (``all`` and ``every:N`` follow the new depth).

    Either scale is the layer dropout of the weights' last step (``trained_steps``, the checkpoint's step: a
    ``linear`` or ``progressive`` schedule may not have reached its rate, :func:`pretrain.model.layerdrop.as_of`;
    None: the schedule's final rate).
    """
    if scale not in PRUNE_SCALES:
        raise ConfigError(f"prune scale: {scale!r}: expected one of {', '.join(PRUNE_SCALES)}")
    trained = cfg.layer_drop if trained_steps is None else as_of(cfg.layer_drop, trained_steps - 1)
    scales = inference_scales(trained, cfg.model.num_layers)
    if scale == "train":
        rates = layer_rates(trained, cfg.model.num_layers, trained.rate)
        inverted = trained.enabled and trained.scaling == "inverted"
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
    if model.norm_placement == "deepnorm":  # alpha = (2N)^(1/4) of the parent's depth: the parent's forward, exactly
        model = dataclasses.replace(model, deepnorm_depth=cfg.model.deepnorm_depth or cfg.model.num_layers)
    exits = layer_drop.early_exit
    if isinstance(exits.layers, list):  # listed exits as deep as the pruned model or deeper go
        kept = [d for d in exits.layers if d < len(keep)]
        layer_drop = dataclasses.replace(layer_drop, early_exit=dataclasses.replace(exits, layers=kept))
    moe = cfg.moe
    if moe.enabled:
        moe_blocks = [new_index[i] for i in keep if moe.is_moe_layer(i)]
        if not moe_blocks:
            moe = dataclasses.replace(moe, num_experts=0, layers=[])
        else:
            moe = dataclasses.replace(moe, layers=moe_blocks, every=1)
    new = dataclasses.replace(cfg, model=model, moe=moe, layer_drop=layer_drop, name=f"{cfg.name}-pruned{len(keep)}")
    return new, out


def prune(argv: list[str], checkpoint_dir: str | None = None) -> int:
    """``prune RUN_ID|CHECKPOINT layers=SPEC [step=N] [scale=inference|train]``; ``checkpoint_dir``: where the new
    run's checkpoints go (default: the parent's ``checkpoint.dir``)."""
    opts = parse_options(argv, {"layers", "step", "scale"}, "prune")
    parent = resolve_checkpoint(argv[0], step_option(opts, "prune"))
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
        checkpoint_dir=checkpoint_dir,
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
    print(f"[prune] new run {run_id}: checkpoint {path}")
    cmd, ref, longer = command(), run_ref(run_id, path.parent), resume_overrides(cfg.train, parent.ckpt.step)
    print(
        f"  eval:    {cmd} eval {ref}\n  resume:  {cmd} resume {ref}{' ' + longer if longer else ''}\n"
        f"  export:  {cmd} export {ref} --out exported/{run_id}"
    )
    print_run_link(cfg.tracking.enabled, run_id)
    return 0
