"""Freed host memory kept for the next step (``train.reuse_host_memory``, ``pretrain/train/host_memory.py``),
measured in a fresh process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from pretrain.train.host_memory import keep_freed_host_memory

    def faults(rounds=20):  # what a step does: allocate, write and free the same 64 MiB tensor
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(rounds):
            t = torch.empty(16 << 20)
            t.fill_(1.0)
            del t
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    default = faults()
    took = keep_freed_host_memory()
    faults()  # the first allocation after the change faults its pages once
    kept = faults()
    print(default, kept, took)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    """With glibc's defaults every round faults the 64 MiB in again (16,384 pages); once tuned, the freed block is
    reused: a fresh process (so the test process keeps its allocator) measures both."""
    out = subprocess.run([sys.executable, "-c", FAULTS], capture_output=True, text=True, check=True, timeout=120)
    default, kept, took = out.stdout.split()
    assert took == "True"
    assert int(default) > 20 * 16384 * 0.9, out.stdout
    assert int(kept) < 20 * 16384 * 0.05, out.stdout
