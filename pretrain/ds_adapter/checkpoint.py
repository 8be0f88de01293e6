"""DeepSpeed's checkpoint files: the globals they pickle, their names and layout, routing the engine's saves,
loading with ``weights_only=True``, ZeRO-1/2 optimizer partitions, and the universal form (through
:mod:`pretrain.ds_adapter`)."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

# The only non-tensor globals in 0.19's ZeRO checkpoint files (torch.serialization's
# get_unsafe_globals_in_checkpoint on ZeRO-1/2/3 model and optimizer states).
CHECKPOINT_GLOBALS = (
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
)


def checkpoint_safe_globals() -> list:
    """The classes of :data:`CHECKPOINT_GLOBALS`, for ``torch.serialization.safe_globals`` around a
    ``torch.load(..., weights_only=True)`` of a DeepSpeed checkpoint file."""
    return [getattr(importlib.import_module(mod), name) for mod, name in CHECKPOINT_GLOBALS]


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every ``torch.load`` in the block unpickles with ``weights_only=True`` and the allowlist of
    :func:`checkpoint_safe_globals`, whatever its caller passes: 0.19's ``zero_to_fp32``, ``ds_to_universal`` and
    the optimizers' loads of the universal form pass ``weights_only=False``, and a checkpoint file must not run code
    (``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, which ``torch.load`` reads at each call, set for the block, and the user's
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, which torch refuses beside it, unset). The variables and the allowlist are
    process-wide: one block at a time (a load in another thread meanwhile is restricted too)."""
    # As (class, "module.name") pairs: torch's safe_globals removes its entries on exit, so a nested block of the
    # bare classes (the engine's own loads) would otherwise take this block's allowlist with it.
    named: list[Callable | tuple[Callable, str]] = [
        (cls, f"{mod}.{name}") for cls, (mod, name) in zip(checkpoint_safe_globals(), CHECKPOINT_GLOBALS)
    ]
    saved = {k: os.environ.pop(k, None) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(named):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_RANK_STATE_FILE = re.compile(r"(?:^|/)(?:\w*_)?pp_rank_(\d+)_")


def rank_of_state_file(rel: str) -> int | None:
    """The data-parallel rank whose partition a DeepSpeed checkpoint file holds (0.19 names them
    ``[bf16_]zero_pp_rank_R_mp_rank_00_{optim,model}_states.pt``), or None for a shared file."""
    m = _RANK_STATE_FILE.search(rel)
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def without_zip_crc():
    """``torch.save`` without the zip format's CRC-32 of every record (``torch.utils.serialization.config``,
    torch >= 2.6): our checkpoint files carry a sha256 each, so the CRC is a second checksum of the same bytes and
    a large share of ``torch.save``'s CPU time. ``torch.load`` reads such files as any other. The setting is the
    calling thread's (torch's config module keeps overrides per thread): enter the block in the thread that
    writes."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch < 2.6
        config = None
    save = getattr(config, "save", None)
    if save is None or not hasattr(save, "compute_crc32"):
        yield
        return
    before, save.compute_crc32 = save.compute_crc32, False
    try:
        yield
    finally:
        save.compute_crc32 = before


Save = Callable[[Any, Any], None]
"""The checkpoint engine's own save of one file: ``save(state_dict, target)``, ``target`` a path or, when
:func:`saves_into_files`, an open binary file."""


def saves_into_files(engine) -> bool:
    """The engine's checkpoint engine saves with DeepSpeed's ``TorchCheckpointEngine.save``, which hands its target
    to ``torch.save`` as is, so it can write into an open file (e.g. one that hashes what it is given). Ours is
    a subclass that changes loading only (:func:`use_weights_only_loading`)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type(engine.checkpoint_engine).save is TorchCheckpointEngine.save


def checkpoint_state_stays_live(engine) -> bool:
    """The state dicts ``save_checkpoint`` hands to its checkpoint engine stay valid until the next step: no
    checkpoint epilogue swaps the optimizer state out again (ZeRO-3 with NVMe offload has one). Only then may a
    synchronous save write them after ``save_checkpoint`` returns (:func:`routing_checkpoint_files`)."""
    return not engine._optimizer_has_ckpt_event_epilogue()


@contextlib.contextmanager
def routing_checkpoint_files(engine, route: Callable[[Any, Path, Save], None]):
    """Within the block, every file the engine's checkpoint engine would save is handed to ``route(state_dict,
    path, save)`` instead, ``save`` being the engine's own (``torch.save`` with its serialization setting) for the
    route to call now, later or elsewhere (e.g. after copying the state to host memory for a background write).
    Wraps ``engine.checkpoint_engine.save`` (0.19: every model, optimizer and expert file of ``save_checkpoint``
    goes through it; its collectives and directory creation still run; only rank 0's recovery scripts are
    copied directly, at once) on the instance, restored afterwards. ZeRO's ``optimizer.state_dict()`` holds the
    live tensors."""
    ckpt_engine = engine.checkpoint_engine
    ds_save = ckpt_engine.save

    def routed(state_dict, path, *args, **kwargs):
        route(state_dict, Path(path), ds_save)

    ckpt_engine.save = routed
    try:
        yield
    finally:
        del ckpt_engine.save  # the class's method again


def use_weights_only_loading(engine) -> None:
    """Make the engine unpickle its checkpoint files with ``weights_only=True`` and the allowlist of
    :func:`checkpoint_safe_globals` (0.19's ``TorchCheckpointEngine.load`` uses ``weights_only=False``), so a
    checkpoint cannot run code. Replaces ``engine.checkpoint_engine`` (built from ``engine._config``) by a
    subclass; another configured engine (async, Nebula) is left alone."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
        return
    allowed = checkpoint_safe_globals()

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)

    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine._config)


def module_state_files(tag_dir: Path) -> list[Path]:
    """The per-rank module state files of one checkpoint tag directory, rank 0 first. 0.19's layout:
    ``mp_rank_{mp:02d}_model_states.pt`` (ZeRO-3: ``zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt``),
    each a dict whose ``module`` entry is the module state dict (ZeRO-3: placeholders)."""
    return sorted(tag_dir.glob("mp_rank_*_model_states.pt"))


def expert_state_files(tag_dir: Path) -> list[Path]:
    """0.19's one file per expert of an expert-parallel checkpoint,
    ``layer_{l}_expert_{e}_mp_rank_{mp:02d}_model_states.pt``: a plain state dict whose keys carry the global
    expert id."""
    return sorted(tag_dir.glob("layer_*_expert_*_mp_rank_*_model_states.pt"))


def load_module_state(path: Path) -> dict:
    """The module state dict in one of :func:`module_state_files` (its ``module`` entry), on the CPU, loaded with
    ``weights_only`` (the caller allows :func:`checkpoint_safe_globals`)."""
    return torch.load(path, map_location="cpu", weights_only=True)["module"]


def zero_optimizer_files(tag_dir: Path) -> list[Path]:
    """The ZeRO-1/2 optimizer files of one checkpoint tag directory, one per data-parallel rank in rank order (0.19:
    ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``, R the rank in the dense data-parallel group)."""
    files = [f for f in tag_dir.glob("*zero_pp_rank_*_mp_rank_*_optim_states.pt")]
    return sorted(files, key=lambda f: cast(int, rank_of_state_file(f.name)))  # the glob matches rank files only


def zero_partitions(path: Path) -> list[dict[str, Any]]:
    """The partitions one rank's ZeRO-1/2 optimizer file holds, one per optimizer parameter group:
    ``{"partitions": n, "moe": bool, "step": int, "fp32" | "exp_avg" | "exp_avg_sq": flat tensor,
    "slices": {parameter name: (start, numel)}}``. 0.19's ``optimizer_state_dict`` keeps per group the flat fp32
    partition (``single_partition_of_fp32_groups``), the torch optimizer's state of it (``base_optimizer_state``,
    unless ``elastic_checkpoint``), the group's partition count (the size of its data-parallel group: the
    expert-data-parallel group for ``moe`` groups) and ``param_slice_mappings``: each module parameter (its name in
    the engine's module, experts under local ids) with a fragment in this partition -> ``fragment_address``."""
    with torch.serialization.safe_globals(checkpoint_safe_globals()):
        sd = torch.load(path, map_location="cpu", weights_only=True)["optimizer_state_dict"]
    base = sd["base_optimizer_state"]
    if not isinstance(base, dict):
        raise ValueError(f"{path.name}: elastic ZeRO optimizer state is not supported")
    groups = []
    for i, fp32 in enumerate(sd["single_partition_of_fp32_groups"]):
        state = base["state"][base["param_groups"][i]["params"][0]]
        groups.append(
            {
                "partitions": int(sd["partition_count"][i]),
                "moe": bool(base["param_groups"][i].get("moe")),
                "step": int(state["step"]),
                "fp32": fp32,
                "exp_avg": state["exp_avg"],
                "exp_avg_sq": state["exp_avg_sq"],
                "slices": {name: (a.start, a.numel) for name, a in sd["param_slice_mappings"][i].items()},
            }
        )
    return groups


def convert_to_universal(input_folder: Path, output_folder: Path) -> None:
    """Convert one DeepSpeed checkpoint tag directory into the universal form in ``output_folder`` (single process;
    missing optimizer state injected). 0.19 has no function API for it: this runs the ``ds_to_universal`` script's
    ``main`` on its own argument parser."""
    from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

    argv, sys.argv = (
        sys.argv,
        [
            "ds_to_universal",
            "--input_folder",
            str(input_folder),
            "--output_folder",
            str(output_folder),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            "--inject_missing_state",
        ],
    )
    try:
        with weights_only_loads():
            main(parse_arguments())
    finally:
        sys.argv = argv
