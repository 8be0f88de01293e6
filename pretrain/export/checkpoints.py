"""Committed checkpoints for export and evaluation: resolve (path, run dir or MLflow run id) and consolidate the
DeepSpeed state into one fp32 state dict of our names (ZeRO partitions merged, every expert of an
expert-parallel run gathered)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain import ds_adapter
from pretrain.config import ConfigError, RunConfig, load_config
from pretrain.export.moe import check_experts_complete, expert_parallel_state_dict
from pretrain.model.layerdrop import fold_branch_scales, inference_scales
from pretrain.train import checkpoint as ckpt_io

StateDict = dict[str, torch.Tensor]


def _strip_module_prefix(sd: StateDict) -> StateDict:
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}


@dataclass
class LoadedCheckpoint:
    ckpt: ckpt_io.CommittedCheckpoint
    config: RunConfig
    run_id: str | None
    """The MLflow run of the checkpoint when it is in the current tracking store, else None."""

    def state_dict(self, inference: bool = True) -> StateDict:
        """Full fp32 state dict; expert-parallel checkpoints hold every expert (checked). ``inference``: with
        layer dropout's ``rho`` scaling folded into the weights (what evaluation and export use); False gives the
        training weights (to continue training from, e.g. after pruning)."""
        moe = self.config.moe
        if moe.enabled and int(self.ckpt.manifest.get("moe_ep_size", moe.ep_size)) > 1:
            sd = _strip_module_prefix(expert_parallel_state_dict(self.ckpt.path / ckpt_io.DS_DIR / ckpt_io.DS_TAG))
            sd = {k: v.detach().to(torch.float32).contiguous() for k, v in sd.items()}
        else:
            sd = consolidated_state_dict(self.ckpt.path, self.config.zero.stage)
        if moe.enabled:
            check_experts_complete(sd, self.config.model, moe)
        scales = inference_scales(self.config.layer_drop, self.config.model.num_layers)
        if inference and scales is not None:
            sd = fold_branch_scales(sd, self.config.model.norm_placement, scales)
        return sd

    def tokenizer(self):
        from pretrain.data import load_or_train_tokenizer

        tok_dir = self.ckpt.path / "tokenizer"
        if not tok_dir.is_dir():
            raise ckpt_io.CheckpointError(f"{self.ckpt.path}: no tokenizer/ directory")
        return load_or_train_tokenizer(dataclasses.replace(self.config.data, tokenizer=str(tok_dir)))


def _pick_step(run_dir: Path, step: int) -> ckpt_io.CommittedCheckpoint:
    found = ckpt_io.list_committed(run_dir)
    for c in found:
        if c.step == step:
            ckpt_io.verify(c.path, c.manifest)
            return c
    steps = ", ".join(str(c.step) for c in found) or "none"
    raise ConfigError(f"--step {step}: no committed checkpoint of that step in {run_dir} (committed: {steps})")


def resolve_checkpoint(target: str, step: int | None = None) -> LoadedCheckpoint:
    """A checkpoint dir, a run dir (latest or ``step``) or an MLflow run id -> verified checkpoint."""
    from pretrain.train import tracking

    path = Path(target).expanduser()
    run_id: str | None = None
    if path.exists():
        if step is not None and not (path / ckpt_io.MANIFEST).is_file():
            ckpt = _pick_step(path.resolve(), step)
        else:
            ckpt = ckpt_io.resolve(path)
            if step is not None and ckpt.step != step:
                raise ConfigError(f"--step {step}: {ckpt.path} is the checkpoint of step {ckpt.step}")
        candidate = str(ckpt.manifest.get("run_id") or "")
        if candidate and not candidate.startswith("local-"):
            run_id = candidate if tracking.find_run(tracking.tracking_uri(), candidate) is not None else None
    elif "/" in target or target.startswith("."):  # a path, not a run id: do not touch the tracking store
        raise ConfigError(f"{target}: no such checkpoint or run directory")
    else:
        root = tracking.run_checkpoint_root(tracking.tracking_uri(), target)
        if step is not None:
            ckpt = _pick_step(Path(root), step)
        else:
            latest = ckpt_io.latest_committed(Path(root))
            if latest is None:
                raise ConfigError(f"{target}: no committed checkpoint in {root}")
            ckpt_io.verify(latest.path, latest.manifest)
            ckpt = latest
        run_id = target
    import yaml

    cfg_file = ckpt.path / "config.yaml"
    if not cfg_file.is_file():
        raise ckpt_io.CheckpointError(f"{ckpt.path}: no config.yaml")
    cfg = load_config(None, base=yaml.safe_load(cfg_file.read_text()))
    return LoadedCheckpoint(ckpt=ckpt, config=cfg, run_id=run_id)


def consolidated_state_dict(ckpt_path: Path, zero_stage: int) -> StateDict:
    """One fp32 state dict (our names) from the DeepSpeed state of a committed checkpoint.

    ZeRO 1/2/3 (any worker count): DeepSpeed's ``zero_to_fp32`` merges the fp32 master partitions.
    Stage 0 (plain data parallel): the full module state of rank 0.
    """
    ds = ckpt_path / ckpt_io.DS_DIR
    if zero_stage == 0:
        files = ds_adapter.module_state_files(ds / ckpt_io.DS_TAG)
        if not files:
            raise ckpt_io.CheckpointError(f"{ckpt_path}: no DeepSpeed model state in {ds / ckpt_io.DS_TAG}")
        sd = ds_adapter.load_module_state(files[0], weights_only=False)
    else:
        if not torch.cuda.is_available():  # consolidation is CPU work; skips DeepSpeed's "no GPU" warning
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # It prints progress to stdout; keep the CLI output (and --json) clean.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            sd = get_fp32_state_dict_from_zero_checkpoint(str(ds), tag=ckpt_io.DS_TAG)
    return {k: v.detach().to(torch.float32).contiguous() for k, v in _strip_module_prefix(sd).items()}
