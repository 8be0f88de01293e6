"""Model and optimizer state in a checkpoint, in either format of the manifest:

* ``deepspeed``: a DeepSpeed engine checkpoint under ``ds/state``; merged here into one fp32 state dict of our
  parameter names (ZeRO partitions merged with DeepSpeed's ``zero_to_fp32``, every expert of an expert-parallel
  run gathered from its per-expert files), or converted to DeepSpeed's universal form for another worker count.
* ``full``: ``weights.safetensors`` (fp32, our names, every expert under its global id) and, optionally,
  ``optimizer.safetensors``: AdamW's moments by parameter name — tensors ``exp_avg/<name>`` and
  ``exp_avg_sq/<name>`` of the parameter's full shape, and the optimizer step count in the metadata (``step``).
  Both are plain safetensors: loading them runs no code.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Any

import torch

from pretrain import ds_adapter
from pretrain.checkpoint import layout
from pretrain.checkpoint.conversions import manifest_key, publish
from pretrain.checkpoint.store import BadCheckpoint, CommittedCheckpoint, new_nonce
from pretrain.parallel.dims import ParallelDims

StateDict = dict[str, torch.Tensor]
MOMENTS = ("exp_avg", "exp_avg_sq")

_EXPERT = re.compile(r"^(blocks\.\d+\.ffn\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..+)$")


def strip_module_prefix(sd: StateDict) -> StateDict:
    return {k[len("module.") :] if k.startswith("module.") else k: v for k, v in sd.items()}


# -- format "full" ---------------------------------------------------------------------------------------------


def save_full_weights(directory: Path, weights: StateDict) -> None:
    from safetensors.torch import save_file

    out, storages = {}, set()
    for key, value in weights.items():
        t = value.detach().to("cpu", torch.float32 if value.is_floating_point() else value.dtype).contiguous()
        if t.untyped_storage().data_ptr() in storages:  # tied weights (lm_head = embeddings): safetensors stores
            t = t.clone()  # no shared memory, so each name gets its own copy
        storages.add(t.untyped_storage().data_ptr())
        out[key] = t
    save_file(out, str(directory / layout.WEIGHTS))


def load_full_weights(ckpt_path: Path) -> StateDict:
    from safetensors.torch import load_file

    path = ckpt_path / layout.WEIGHTS
    if not path.is_file():
        raise BadCheckpoint(f"{ckpt_path}: no {layout.WEIGHTS}")
    return load_file(str(path))


def save_optimizer_moments(directory: Path, moments: dict[str, Any]) -> None:
    """``moments``: ``{"step": n, "exp_avg": {name: tensor}, "exp_avg_sq": {name: tensor}}`` (full tensors)."""
    from safetensors.torch import save_file

    tensors = {
        f"{key}/{name}": t.detach().to("cpu", torch.float32).contiguous()
        for key in MOMENTS
        for name, t in moments.get(key, {}).items()
    }
    save_file(tensors, str(directory / layout.OPTIMIZER), metadata={"step": str(int(moments.get("step", 0)))})


def load_optimizer_moments(ckpt_path: Path) -> dict[str, Any] | None:
    """The moments saved by :func:`save_optimizer_moments`, or None when the checkpoint has none."""
    from safetensors import safe_open

    path = ckpt_path / layout.OPTIMIZER
    if not path.is_file():
        return None
    out: dict[str, Any] = {key: {} for key in MOMENTS}
    with safe_open(str(path), framework="pt") as f:
        out["step"] = int((f.metadata() or {}).get("step", 0))
        for name in f.keys():
            key, param = name.split("/", 1)
            out[key][param] = f.get_tensor(name)
    return out


# -- format "deepspeed" ----------------------------------------------------------------------------------------


def ds_engine_dir(ckpt_path: Path) -> Path:
    """The directory a DeepSpeed engine saves into / loads from (``tag`` = :data:`layout.DS_TAG`)."""
    return ckpt_path / layout.DS_DIR


def consolidated_state_dict(ckpt_path: Path, zero_stage: int) -> StateDict:
    """One fp32 state dict (our names) from the DeepSpeed state of a committed checkpoint.

    ZeRO 1/2/3 (any worker count): DeepSpeed's ``zero_to_fp32`` merges the fp32 master partitions.
    Stage 0 (plain data parallel): the full module state of rank 0; under bf16 that is the bf16 weights (the fp32
    masters of DeepSpeed's unfused optimizer, saved beside them by parameter group, are not read).
    """
    ds = ds_engine_dir(ckpt_path)
    if zero_stage == 0:
        files = ds_adapter.module_state_files(ds / layout.DS_TAG)
        if not files:
            raise BadCheckpoint(f"{ckpt_path}: no DeepSpeed model state in {ds / layout.DS_TAG}")
        sd = _load_ds_module_states(files[0])
    else:
        if not torch.cuda.is_available():  # consolidation is CPU work; skips DeepSpeed's "no GPU" warning
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # It prints progress to stdout; keep the CLI output (and --json) clean.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            with ds_adapter.weights_only_loads():
                sd = get_fp32_state_dict_from_zero_checkpoint(str(ds), tag=layout.DS_TAG)
    return {k: v.detach().to(torch.float32).contiguous() for k, v in strip_module_prefix(sd).items()}


def _load_ds_module_states(path: Path) -> StateDict:
    """The ``module`` weights of a DeepSpeed model-states file, loaded with ``weights_only`` (no code runs; the
    adapter's allowlist admits the few DeepSpeed classes such files hold)."""
    with torch.serialization.safe_globals(ds_adapter.checkpoint_safe_globals()):
        return dict(ds_adapter.load_module_state(path))


def expert_parallel_state_dict(ds_tag_dir: Path) -> StateDict:
    """Full state dict of an expert-parallel DeepSpeed checkpoint: the module state of rank 0 (dense weights)
    plus DeepSpeed's one file per expert (``layer_{l}_expert_{e}_mp_rank_00_model_states.pt``, keys already
    carrying the global expert id). Values are the module weights in the training dtype (exact fp32 for fp32
    runs); DeepSpeed's ``zero_to_fp32`` does not understand expert-partitioned optimizer state."""
    main = ds_adapter.module_state_files(ds_tag_dir)
    if not main:
        raise FileNotFoundError(f"no DeepSpeed model state in {ds_tag_dir}")
    sd = _load_ds_module_states(main[0])
    files = ds_adapter.expert_state_files(ds_tag_dir)
    if not files:
        raise FileNotFoundError(f"no per-expert files (layer_*_expert_*) in {ds_tag_dir}")
    for f in files:
        for key, value in torch.load(f, map_location="cpu", weights_only=True).items():
            sd[key] = value
    return sd


def _global_expert_name(name: str, offset: int) -> str:
    """``name`` with its expert id (a local id on an expert-parallel rank) shifted by ``offset``."""
    m = _EXPERT.match(name)
    return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}" if m and offset else name


def gathered_optimizer_state(
    ckpt_path: Path, num_experts: int, moments: bool = True
) -> tuple[StateDict, dict[str, Any]]:
    """(fp32 master weights, AdamW moments) by parameter name, flat, merged from every rank's ZeRO-1/2 partitions
    of a DeepSpeed checkpoint of any expert layout (experts under their global ids). A group partitioned over
    ``n`` of the ``W`` ranks (dense: all; experts: the expert-data-parallel group of ``W / n`` = ep_size
    consecutive-rank EP groups) holds on rank ``r`` partition ``r // (W / n)``, and its experts are those of
    expert-parallel rank ``r % (W / n)``; a parameter is the concatenation of its fragments in partition order.
    ``moments`` False: the masters alone (the moments' dict has the step only)."""
    files = ds_adapter.zero_optimizer_files(ds_engine_dir(ckpt_path) / layout.DS_TAG)
    if not files:
        raise BadCheckpoint(f"{ckpt_path}: no ZeRO-1/2 optimizer state to re-shard")
    world, step = len(files), 0
    pieces: dict[str, dict[str, dict[int, torch.Tensor]]] = {key: {} for key in ("fp32", *(MOMENTS if moments else ()))}
    for path in files:
        rank = ds_adapter.rank_of_state_file(path.name)
        assert rank is not None, path  # zero_optimizer_files lists per-rank files only
        for group in ds_adapter.zero_partitions(path):
            ep = world // group["partitions"]
            dims = ParallelDims(world=world, expert=ep)  # the saved expert layout
            offset = dims.expert_rank(rank) * (num_experts // ep) if group["moe"] else 0
            step = max(step, group["step"])
            for name, (start, numel) in group["slices"].items():
                name = _global_expert_name(name, offset)
                for key, by_name in pieces.items():
                    by_name.setdefault(name, {})[dims.expert_data_rank(rank)] = group[key][start : start + numel]
    merged = {
        key: {name: torch.cat([parts[i] for i in sorted(parts)]).float() for name, parts in by_name.items()}
        for key, by_name in pieces.items()
    }
    return merged["fp32"], {"step": step, **{key: merged[key] for key in MOMENTS if key in merged}}


def check_experts_complete(sd: StateDict, num_layers: int, moe) -> None:
    """Every MoE block has experts 0..E-1 (guards consolidation of a partial checkpoint)."""
    seen: dict[str, set[int]] = {}
    for key in sd:
        m = _EXPERT.match(key[len("module.") :] if key.startswith("module.") else key)
        if m:
            seen.setdefault(m.group(1), set()).add(int(m.group(2)))
    for i in range(num_layers):
        if moe.is_moe_layer(i):
            got = seen.get(f"blocks.{i}.ffn.deepspeed_moe.experts.deepspeed_experts.", set())
            if got != set(range(moe.num_experts)):
                raise ValueError(
                    f"block {i}: experts {sorted(got)} in the checkpoint, expected 0..{moe.num_experts - 1}"
                )


def universal_checkpoint(ckpt: CommittedCheckpoint, cache_root: Path) -> Path:
    """DeepSpeed universal form of ``ckpt`` (for resuming with a different worker count), converted once
    and cached under ``cache_root``, keyed by its manifest (:func:`conversions.manifest_key`); staged and renamed so an
    interrupted conversion is never used. Returns the directory to pass to the engine's load (tag
    :data:`layout.DS_TAG`)."""
    final = layout.universal_dir(cache_root, ckpt.step, manifest_key(ckpt))
    if (final / layout.DS_TAG).is_dir():
        return final
    stage = layout.universal_staging_dir(cache_root, ckpt.step, new_nonce())
    ds_adapter.convert_to_universal(ds_engine_dir(ckpt.path) / layout.DS_TAG, stage / layout.DS_TAG)
    return publish(stage, final)
