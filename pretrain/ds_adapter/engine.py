"""The engine's runtime: its communication backend, the device it binds, the accelerator DeepSpeed chose, and
which checkpoint form its next load reads (through :mod:`pretrain.ds_adapter`)."""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

import torch

# -- communication backend ------------------------------------------------------------------------------------------


SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_op(world_size: int) -> None:
    """A world of one has no peer to reduce with, so DeepSpeed's shared-memory CPU all-reduce op is not built for
    it. 0.19: ``deepspeed.comm.torch.build_shm_op`` builds it (a JIT C++ build on its first use on a machine, tens
    of seconds) when the communication backend starts in ``deepspeed.initialize``, unless
    ``deepspeed.ops.__compatible_ops__`` marks it incompatible; marked so, the backend uses torch.distributed alone.
    Larger worlds keep the op (DeepSpeed's CPU all-reduce). Only on DeepSpeed's CPU accelerator: the others have no
    such op (``build_shm_op`` returns None at once), and reading ``deepspeed.ops.__compatible_ops__`` probes every op
    builder (compiler and GPU queries in subprocesses, seconds per process)."""
    if world_size == 1 and loaded_accelerator() in (None, "cpu"):
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


# -- the import ---------------------------------------------------------------------------------------------------


def import_deepspeed() -> types.ModuleType:
    """DeepSpeed, imported now, without its autotuner's MLflow import where this process has not imported MLflow.

    0.19: ``import deepspeed`` imports ``deepspeed.autotuning.autotuner``, which runs ``import mlflow`` inside a
    ``try`` for the autotuner's own logging (``deepspeed --autotuning``, which nothing here runs). That is most of
    DeepSpeed's own import time, in every worker, including the ranks that never log to MLflow.
    So where MLflow is not imported yet, its name is held as absent (``sys.modules["mlflow"] = None``: an
    ``import mlflow`` raises ImportError and the autotuner goes without) for the length of DeepSpeed's import only;
    a later ``import mlflow`` (the tracking rank's) imports it as usual. Call it before this process starts threads
    of its own that may import MLflow. DeepSpeed chooses its accelerator at this import (``DS_ACCELERATOR``).
    Its Muon optimizer is imported too, its kernels compiled when first called
    (:func:`import_compiling_on_first_call`)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    held = "mlflow" not in sys.modules
    if held:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    finally:
        if held and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    import_compiling_on_first_call(MUON_MODULE)
    return deepspeed


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"
"""DeepSpeed's Muon optimizer (0.19), which its ZeRO optimizers import whatever the optimizer."""


def import_compiling_on_first_call(module: str) -> None:
    """Import ``module`` with the ``torch.compile`` it applies at import set up when each compiled function is first
    called; a module missing from this DeepSpeed is skipped.

    For :data:`MUON_MODULE`. 0.19: the ZeRO optimizers import it (for ``isinstance`` checks against
    ``MuonWithAuxAdam``: ``DeepSpeedEngine``'s ZeRO support check, stage 1-2's ``average_tensor`` on every
    reduction, stage 3's init) whatever the optimizer, and its modules decorate their kernels with ``torch.compile``
    (``deepspeed.runtime.compiler.compile()`` returns it). The first ``torch.compile`` of a process sets up its
    backend: about a CPU-second in every process that builds an engine, for kernels only a Muon optimizer calls.
    So while the module imports, ``torch.compile`` returns a wrapper that compiles the function (with the same
    options) on its first call; the real ``torch.compile`` is back when the import ends. ``torch.compile``
    compiles at the first call anyway, so a Muon run compiles the same kernels; only the set-up moves. Call it
    before this process starts threads of its own."""
    if module in sys.modules:
        return
    real = torch.compile

    def on_first_call(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: on_first_call(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)

        return call

    torch.compile = on_first_call
    try:
        importlib.import_module(module)
    except ImportError:  # not in this DeepSpeed
        pass
    finally:
        torch.compile = real


# -- the engine ---------------------------------------------------------------------------------------------------


def engine_args(device: torch.device) -> Any:
    """The ``args`` of ``deepspeed.initialize`` that keep the engine on ``device`` (None off CUDA). 0.19's engine
    calls ``set_device`` on ``args.device_rank`` when the args have one, else on the ``LOCAL_RANK`` environment
    variable (``_set_distributed_vars``): not this worker's GPU where each worker sees only its own (Slurm's
    ``--gpus-per-task=1``: an invalid ordinal from local rank 1 on), nor where Ray assigned the node's GPUs in
    another order. AutoTP's partitioning still selects ``LOCAL_RANK``'s device (``_apply_autotp_partitioning``)."""
    if device.type != "cuda" or device.index is None:
        return None
    return types.SimpleNamespace(device_rank=device.index)


def loaded_accelerator() -> str | None:
    """The device type of the accelerator DeepSpeed chose (``cuda``, ``cpu``, ...), or None before DeepSpeed is
    imported. 0.19 chooses it once, at import, from ``DS_ACCELERATOR`` or by probing (``get_accelerator``)."""
    if "deepspeed" not in sys.modules:
        return None
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def set_universal_load(engine, universal: bool) -> None:
    """Whether the engine's next ``load_checkpoint`` reads DeepSpeed's universal form (another worker count). 0.19
    reads it from the engine's config at load time (``engine.load_universal_checkpoint()`` returns
    ``engine._config.load_universal_checkpoint``); the config key ``checkpoint.load_universal`` only sets it at
    ``initialize``."""
    engine._config.load_universal_checkpoint = universal
