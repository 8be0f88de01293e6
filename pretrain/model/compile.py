"""Regional compilation: each Transformer block is compiled on its own with ``torch.compile``.

Blocks of one model share their code, and dynamo treats the parameters of an inlined module as graph inputs,
so one compiled graph serves every block of the same shapes: compiling a 24-block model costs about what one
block does, a grown model recompiles only blocks whose shapes changed, and embeddings, loss and the optimizer
stay eager (where DeepSpeed's hooks live).

Layer dropout passes its decisions as block arguments: a skipped block is not called at all, a scale is a
Python float that dynamo does not specialize on (``specialize_float`` is off in torch >= 2.6), and a per-sample
gate is a tensor, so a changing drop pattern does not recompile (tests/unit/model/test_compile.py counts it).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn as nn


def compile_blocks(model: nn.Module, **options) -> int:
    """Compile every not yet compiled block of ``model.blocks`` in place (``nn.Module.compile``); returns how many
    were compiled. ``options`` go to ``torch.compile`` (default: inductor, static shapes first)."""
    from pretrain.model.moe import keep_experts_eager

    keep_experts_eager()
    compiled = 0
    for block in cast(nn.ModuleList, model.blocks):
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(**options)
            compiled += 1
    return compiled


def is_compiled(model: nn.Module) -> bool:
    return any(getattr(b, "_compiled_call_impl", None) is not None for b in cast(nn.ModuleList, model.blocks))


def compile_supported(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch.compile``'s inductor backend can run here, and why not (it needs a C++ compiler on CPU;
    on CUDA Triton, which builds its kernel launcher with a C compiler and the Python headers at first use)."""
    import os
    import shutil
    import sysconfig

    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False, "torch.compile on CUDA needs triton (pip install triton)"
        # as Triton looks for them (triton/runtime/build.py): $CC, else gcc or clang; the headers of its scheme
        if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
            return False, "torch.compile on CUDA needs a C compiler for Triton's launcher (gcc or clang, or set CC)"
        scheme = sysconfig.get_default_scheme()
        headers = sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme).get("include", "")
        if not os.path.isfile(os.path.join(headers, "Python.h")):
            return False, f"torch.compile on CUDA needs the Python headers for Triton (no {headers}/Python.h)"
        return True, ""
    if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        return False, "torch.compile on CPU needs a C++ compiler (g++ or clang++)"
    return True, ""
