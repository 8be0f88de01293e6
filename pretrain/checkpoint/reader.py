"""Reading a committed checkpoint: its config, trainer state, tokenizer, data position and RNG, and its model as
one full fp32 state dict whatever the format (merged from any ZeRO stage and worker count, every expert of an
expert-parallel run gathered). :func:`open_checkpoint` finds and verifies one by path; resolving an MLflow run id
to its checkpoint directory is the caller's (``pretrain/export/checkpoints.py``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain import ds_adapter
from pretrain.checkpoint import conversions, layout, store, weights
from pretrain.checkpoint.manifest import FORMAT_FULL
from pretrain.checkpoint.store import BadCheckpoint, CheckpointError, CommittedCheckpoint
from pretrain.config import ConfigError, RunConfig, load_config
from pretrain.config.moved import migrate
from pretrain.config.yaml_reading import read_yaml

StateDict = dict[str, torch.Tensor]


def config_dict(ckpt: CommittedCheckpoint) -> dict[str, Any]:
    """The checkpoint's resolved config as a plain dict (CheckpointError when it has none), read as a config file is
    (:func:`~pretrain.config.yaml_reading.read_yaml`: an alias bomb is refused before it is expanded)."""
    path = ckpt.path / layout.CONFIG
    if not path.is_file():
        raise BadCheckpoint(f"{ckpt.path}: no {layout.CONFIG}")
    return migrate(read_yaml(path) or {})  # written by an older version: moved keys under their new names


def read_config(ckpt: CommittedCheckpoint, overrides: list[str] | None = None) -> RunConfig:
    """The checkpoint's config (``overrides`` applied), its tokenizer set to the checkpoint's own."""
    cfg = load_config(None, overrides or [], base=config_dict(ckpt))
    cfg.data.tokenizer = str(tokenizer_dir(ckpt))
    return cfg


def tokenizer_dir(ckpt: CommittedCheckpoint) -> Path:
    return ckpt.path / layout.TOKENIZER


def read_trainer_state(ckpt: CommittedCheckpoint) -> dict[str, Any]:
    """The saved trainer state (counters and callback state) as written, migrated to the current keys."""
    raw = json.loads((ckpt.path / layout.TRAINER_STATE).read_text())
    if "sequences" not in raw:  # absent: no rollback moved the data, so the manifest's count is the position
        raw["sequences"] = ckpt.manifest.global_sequences
    return raw


def read_data_position(ckpt_path: Path) -> dict[str, Any]:
    """The merged data state of all ranks (the global data position; any worker count can resume it)."""
    from pretrain.data import merge_states  # the data package is heavy to import; only resumes need it

    files = sorted((ckpt_path / layout.data_file(0)).parent.glob(layout.DATA_GLOB))
    return merge_states([json.loads(f.read_text()) for f in files])


def read_rng_state(ckpt_path: Path, rank: int) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s RNG state, or None when the checkpoint has none for it (another worker count)."""
    path = ckpt_path / layout.rng_file(rank)
    return torch.load(path, weights_only=True) if path.is_file() else None


def load_rank_state(ckpt_path: Path, rank: int) -> tuple[dict, dict | None]:
    """(merged data state of all ranks, this rank's RNG state): the RNG state is None only when the checkpoint has
    none for ``rank`` (saved by fewer workers); with fewer workers now, each rank gets the saved state of its
    number."""
    return read_data_position(ckpt_path), read_rng_state(ckpt_path, rank)


def is_full_weights(ckpt: CommittedCheckpoint) -> bool:
    return ckpt.manifest.format == FORMAT_FULL


def full_state_dict(ckpt: CommittedCheckpoint, cfg: RunConfig, masters: StateDict | None = None) -> StateDict:
    """The model's full fp32 training weights (our names, every expert under its global id; checked): each
    parameter's fp32 master where the checkpoint keeps one. An expert-parallel checkpoint's module weights hold the
    training dtype; under bf16 its parameters come from the masters in the ZeRO optimizer files (``masters``, when
    the caller has them read already) and its buffers from the module state (docs/moe.md#export)."""
    moe = cfg.moe
    if is_full_weights(ckpt):
        sd = weights.load_full_weights(ckpt.path)
    elif moe.enabled and (ckpt.manifest.moe_ep_size or cfg.parallel.expert) > 1:
        ds_tag = weights.ds_engine_dir(ckpt.path) / layout.DS_TAG
        sd = weights.strip_module_prefix(weights.expert_parallel_state_dict(ds_tag))
        low = any(v.dtype in (torch.bfloat16, torch.float16) for v in sd.values())
        sd = {k: v.detach().to(torch.float32).contiguous() for k, v in sd.items()}
        if masters is None and low and ds_adapter.zero_optimizer_files(ds_tag):
            masters, _ = weights.gathered_optimizer_state(ckpt.path, moe.num_experts, moments=False)
    else:
        sd = weights.consolidated_state_dict(ckpt.path, cfg.zero.stage)
    if masters is not None:
        sd = _with_masters(sd, masters, ckpt, cfg)
    if moe.enabled:
        weights.check_experts_complete(sd, cfg.model.num_layers, moe)
    return sd


def _with_masters(sd: StateDict, masters: StateDict, ckpt: CommittedCheckpoint, cfg: RunConfig) -> StateDict:
    """``sd`` with every parameter replaced by its flat fp32 master (shaped as in ``sd``); buffers kept."""
    unknown = sorted(set(masters) - set(sd))
    if unknown:
        raise CheckpointError(f"{ckpt.path}: optimizer state of unknown parameters {unknown[:3]}")
    out = {**sd, **{name: flat.detach().view(sd[name].shape) for name, flat in masters.items()}}
    if cfg.model.tie_embeddings and "lm_head.weight" in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def resharded_full_form(ckpt: CommittedCheckpoint, cache_root: Path) -> Path:
    """``ckpt``'s DeepSpeed state (ZeRO-1/2, any expert layout) as format ``full`` — every weight as its fp32 master
    and AdamW's moments and step, experts under their global ids — to resume on another expert-parallel layout,
    which DeepSpeed's own loading (and its universal form) cannot. Converted once (single process) and cached
    under ``cache_root``, keyed by the manifest's hash; staged and renamed so an interrupted conversion is never
    used. Returns the directory to read with :func:`weights.load_full_weights` / ``load_optimizer_moments``."""
    final = layout.resharded_dir(cache_root, ckpt.step, conversions.manifest_key(ckpt))
    if (final / layout.OPTIMIZER).is_file():
        return final
    cfg = load(ckpt).config
    if cfg.zero.stage not in (1, 2):
        ep = ckpt.manifest.moe_ep_size
        raise BadCheckpoint(
            f"{ckpt.path}: converting its engine state to full weights (for tensor parallelism or another expert "
            f"layout) needs a ZeRO-1/2 checkpoint (this one: ZeRO-{cfg.zero.stage}); resume it as it was saved: "
            + (f"parallel.expert={ep} " if ep else "")
            + f"parallel.tensor={cfg.parallel.tensor} cluster.num_workers={ckpt.manifest.world_size} "
            f"zero.stage={cfg.zero.stage}"
        )
    masters, moments = weights.gathered_optimizer_state(ckpt.path, cfg.moe.num_experts)
    sd = full_state_dict(ckpt, cfg, masters)  # buffers (and shapes) from the module state
    for name in masters:
        for key in weights.MOMENTS:
            moments[key][name] = moments[key][name].view(sd[name].shape)
    stage = layout.resharded_staging_dir(cache_root, ckpt.step, store.new_nonce())
    stage.mkdir(parents=True)
    weights.save_full_weights(stage, sd)
    weights.save_optimizer_moments(stage, moments)
    return conversions.publish(stage, final)


@dataclass
class LoadedCheckpoint:
    ckpt: CommittedCheckpoint
    config: RunConfig
    run_id: str | None = None
    """The MLflow run of the checkpoint when it is in the current tracking store, else None."""

    def state_dict(self, inference: bool = True) -> StateDict:
        """Full fp32 state dict; expert-parallel checkpoints hold every expert (checked). ``inference``: with
        layer dropout's ``rho`` scaling folded into the weights (what evaluation and export use); False gives the
        training weights (to continue training from, e.g. after pruning)."""
        from pretrain.model.layerdrop import as_of, fold_branch_scales, inference_scales

        sd = full_state_dict(self.ckpt, self.config)
        trained = as_of(self.config.layer_drop, self.ckpt.step - 1)  # (a schedule may not have reached its rate)
        scales = inference_scales(trained, self.config.model.num_layers)
        if inference and scales is not None:
            sd = fold_branch_scales(sd, self.config.model.norm_placement, scales)
        return sd

    def trainer_state(self) -> dict[str, Any]:
        return read_trainer_state(self.ckpt)

    def data_position(self) -> dict[str, Any]:
        return read_data_position(self.ckpt.path)

    def tokenizer_dir(self) -> Path:
        return tokenizer_dir(self.ckpt)

    def tokenizer(self):
        from pretrain.data import load_or_train_tokenizer

        tok_dir = tokenizer_dir(self.ckpt)
        if not tok_dir.is_dir():
            raise CheckpointError(f"{self.ckpt.path}: no {layout.TOKENIZER}/ directory")
        return load_or_train_tokenizer(dataclasses.replace(self.config.data, tokenizer=str(tok_dir)))


def pick_step(run_dir: Path, step: int) -> CommittedCheckpoint:
    """The committed checkpoint of ``step`` in ``run_dir``, verified: ConfigError naming the steps there when it has
    none; a damaged one, or one whose manifest cannot be read, is refused naming the newest older checkpoint that
    verifies (for export, eval and the other commands that read a checkpoint: no resume advice)."""
    store.check_directory(run_dir)
    path = run_dir / layout.step_dir_name(step)
    if not path.exists():
        steps = ", ".join(str(c.step) for c in store.list_committed(run_dir)) or "none"
        raise ConfigError(f"--step {step}: no committed checkpoint of that step in {run_dir} (committed: {steps})")
    try:
        ckpt = CommittedCheckpoint(path, step, store.read_manifest(path))
    except CheckpointError as e:
        raise type(e)(store.point_back_before(run_dir, step, str(e), resume=False)) from None
    store.verify_or_point_back(ckpt, resume=False)
    return ckpt


def find_checkpoint(path: Path, step: int | None = None) -> CommittedCheckpoint:
    """A checkpoint directory, or a run directory (its latest, or ``step``), verified; a damaged one is refused
    naming the newest older checkpoint that verifies (no resume advice: export, eval and others read it)."""
    if step is not None and not store.is_checkpoint_dir(path):
        return pick_step(path.resolve(), step)
    ckpt = store.resolve(path, resume=False)
    if step is not None and ckpt.step != step:
        raise ConfigError(f"--step {step}: {ckpt.path} is the checkpoint of step {ckpt.step}")
    return ckpt


def latest_verified(run_dir: Path, what: str) -> CommittedCheckpoint:
    """The latest committed checkpoint of ``run_dir``, verified (ConfigError naming ``what`` when there is none); a
    damaged one is refused with the newest older checkpoint that verifies (:func:`store.verify_or_point_back`)."""
    latest = store.latest_committed(run_dir, resume=False)
    if latest is None:
        raise ConfigError(f"{what}: no committed checkpoint in {run_dir}")
    store.verify_or_point_back(latest, resume=False)
    return latest


def load(ckpt: CommittedCheckpoint, run_id: str | None = None) -> LoadedCheckpoint:
    """``ckpt`` with its config (checkpoint and config errors exit 2)."""
    return LoadedCheckpoint(ckpt=ckpt, config=load_config(None, base=config_dict(ckpt)), run_id=run_id)
