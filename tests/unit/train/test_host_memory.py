"""Freed host memory kept for the next step (``train.reuse_host_memory``, ``pretrain/train/host_memory.py``): the
workers' allocator environment. The effect, measured in a fresh process, is in
``tests/integration/train/test_host_memory.py``."""

from __future__ import annotations

from pretrain.train.host_memory import KEEP_BYTES, worker_malloc_env


def test_worker_env_sets_one_arena_and_keeps_what_the_user_set(monkeypatch):
    from cluster.launch import worker_env

    assert worker_malloc_env({}) == {
        "MALLOC_ARENA_MAX": "1",
        "MALLOC_MMAP_THRESHOLD_": str(KEEP_BYTES),
        "MALLOC_TRIM_THRESHOLD_": str(KEEP_BYTES),
    }
    assert worker_malloc_env({"MALLOC_ARENA_MAX": "4"})["MALLOC_ARENA_MAX"] == "4"
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert worker_env(reuse_host_memory=True)["MALLOC_ARENA_MAX"] == "1"
    assert "MALLOC_ARENA_MAX" not in worker_env(reuse_host_memory=False)
