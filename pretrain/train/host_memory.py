"""Freed host memory kept in the training process for the next step (``train.reuse_host_memory``).

On CPU every step allocates and frees the same large tensors (the demo decoder's logits and their gradient are
32 MiB each, its activations a few MiB). With glibc's defaults such blocks go back to the kernel when they are
freed — blocks above the (dynamic, at most 32 MiB) mmap threshold are unmapped, the top of the heap is trimmed
above 128 KiB — and the next step faults the same pages in again, zero-filled by the kernel: tens of thousands of
minor page faults per step of the demo decoder (over 100 MB zeroed), CPU time taken from every step. Raising both
thresholds once per process keeps that memory mapped and reused (about a tenth of the faults); what the process holds
is then its peak, which training reaches every step anyway. Tensors on a GPU are untouched (CUDA's caching
allocator already reuses them); on a libc without ``mallopt`` (macOS, musl) this does nothing.

A thread other than the main one allocates from an arena of its own, made of 64 MiB heaps that glibc unmaps as
soon as they empty, whatever the thresholds; Ray Train runs the training function in such a thread of its worker
actor. So a Ray worker also starts with one arena (:func:`worker_malloc_env`, read by glibc at process start
only): without it, a step run in that thread faults its memory in again as above, whatever the thresholds.
"""

from __future__ import annotations

import ctypes
import ctypes.util

KEEP_BYTES = 1 << 30
"""Blocks up to this size come from (and return to) the heap; the heap is trimmed only above this much free top."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


def keep_freed_host_memory(keep_bytes: int = KEEP_BYTES) -> bool:
    """Tune glibc's malloc of this process to keep freed blocks up to ``keep_bytes`` for reuse; True when it took.
    Both thresholds are set (setting one alone also freezes the other's dynamic growth, which would leave the
    mmap threshold at 128 KiB: every larger block unmapped when freed and faulted in again)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, keep_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, keep_bytes))


def worker_malloc_env(environ: dict[str, str]) -> dict[str, str]:
    """Environment variables for a worker process started for a run: one malloc arena and the thresholds of
    :func:`keep_freed_host_memory` (glibc's ``MALLOC_*`` aliases of its tunables; ``GLIBC_TUNABLES`` itself does
    not survive Ray's runtime environment, which splits values at ``:``); any the user set in ``environ`` win."""
    ours = {
        "MALLOC_ARENA_MAX": "1",
        "MALLOC_MMAP_THRESHOLD_": str(KEEP_BYTES),
        "MALLOC_TRIM_THRESHOLD_": str(KEEP_BYTES),
    }
    return {k: environ.get(k, v) for k, v in ours.items()}
