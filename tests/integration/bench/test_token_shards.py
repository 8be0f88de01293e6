"""``./launch.sh bench --data --tiny --json`` end to end: the tokenize job with 1 and 2 Ray workers and the two
loaders, through the CLI."""

from __future__ import annotations

import json

from tests.harness import cli


def test_bench_data_tiny_json(tmp_path):
    proc = cli(tmp_path, "bench", "--data", "--tiny", "--json", timeout=600)
    result = json.loads(proc.stdout)
    assert result["outputs_identical"] is True  # 1 and 2 workers wrote the same bytes
    assert result["tokens"] > 100_000
    for key in ("tokenize_1_worker_tokens_per_s", "tokenize_2_workers_tokens_per_s"):
        assert result[key] > 0, key
    assert set(result["loader"]) == {"small", "gpt-125m"}
    for layout in result["loader"].values():
        assert layout["shards_tokens_per_s"] > layout["text_tokens_per_s"] > 0
    assert set(result["goals"]) == {
        "tokenize_scaling>=1.7",
        "loader_ratio[small]>=50",
        "loader_ratio[gpt-125m]>=50",
    }
