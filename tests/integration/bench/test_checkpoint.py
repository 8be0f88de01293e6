"""``./launch.sh bench --checkpoint`` end to end: one tiny size through the CLI, its runs as 2 torchrun ranks
(``cluster.use_ray=false``; the Ray path of a run and of its resume is the end-to-end tests')."""

from __future__ import annotations

import json

from tests.harness import cli


def test_bench_checkpoint_json_for_a_tiny_size(tmp_path):
    """One tiny size through the CLI: a synchronous run with a save before its last step, its resume and (when
    the key exists) the asynchronous run, each as 2 torchrun ranks."""
    proc = cli(
        tmp_path,
        "bench",
        "--checkpoint",
        "--json",
        "--sizes",
        "64",
        "--layers",
        "2",
        "--every",
        "2",
        "--saves",
        "1",
        "--dir",
        str(tmp_path / "bench"),
        "data.tokenizer_vocab_size=512",
        "model.vocab_size=512",
        "cluster.use_ray=false",
        expect=0,
        timeout=900,
    )
    result = json.loads(proc.stdout)
    (row,) = result["sizes"]
    assert row["hidden"] == 64 and row["checkpoint_bytes"] > 0
    assert row["saves_timed"] in (1, 2)  # 2: a checkpointer without per-save records gives the mean of both saves
    assert row["sync_stall_s"] > 0 and row["raw_write_s"] > 0 and row["sync_save_vs_raw"] > 0
    assert len(row["hash_s_per_rank"]) == 2 and all(s > 0 for s in row["hash_s_per_rank"])
    assert row["resume_hashes_each_byte_once"] and row["resume_time_to_first_step_s"] > 0
    assert sum(row["resume_hash_bytes_per_rank"]) == row["checkpoint_bytes"]
    assert (row["async_stall_s"] is None) == bool(result["async_unavailable"])
    assert list((tmp_path / "bench").iterdir()) == [], "the runs are removed"
