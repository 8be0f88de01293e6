"""``./launch.sh bench --gpu --json`` at its tiny size on CPU: every item of the one GPU check reported with its
figure, the ones the CPU can show passing, the GPU-only goals reported as not applicable (not as a pass)."""

from __future__ import annotations

import json
import math

from tests.harness import cli

ITEMS = ("train", "mfu", "sdpa_kernel", "memory_plan", "checkpoint", "zero3", "moe", "growth", "export", "wall_time")


def test_gpu_check_reports_every_item_with_its_figure_at_the_tiny_size(tmp_path):
    proc = cli(
        tmp_path, "bench", "--gpu", "--json", "--dir", str(tmp_path / "runs"), "--results", str(tmp_path), timeout=600
    )
    result = json.loads(proc.stdout)
    (md,) = tmp_path.glob("*-cpu.md")  # the results file: a row per item
    assert all(f"| `{name}` |" in md.read_text() for name in result["items"])
    items = result["items"]
    assert result["tiny"] and result["device"] == "cpu" and result["passed"]
    assert tuple(items) == ITEMS
    for name, v in items.items():
        assert v["status"] in ("pass", "n/a"), (name, v)
        assert v["figure"], name
    for name in ("train", "checkpoint", "zero3", "moe", "growth", "export"):
        assert items[name]["status"] == "pass", (name, items[name])
    assert items["train"]["tokens_per_s"] > 0
    # MFU: a figure (the run's own peak), but its goal is the H100/H200's: not applicable here
    assert items["mfu"]["status"] == "n/a" and 0 < items["mfu"]["mfu"] < 1 and "H100/H200" in items["mfu"]["figure"]
    # the kernel the profiler saw the model's attention run: on CPU, flash's CPU kernel or the math path
    assert items["sdpa_kernel"]["status"] == "n/a" and items["sdpa_kernel"]["figure"] in ("flash (CPU)", "math")
    assert items["sdpa_kernel"]["ops"]
    assert items["memory_plan"]["status"] == "n/a" and items["memory_plan"]["plan_gib"] > 0
    # CPU: the resumed losses equal the uninterrupted run's bitwise, after an asynchronous save
    assert items["checkpoint"]["bitwise"] and items["checkpoint"]["max_relative_diff"] == 0
    assert math.isfinite(items["zero3"]["loss"])
    assert items["growth"]["loss_before"] == items["growth"]["loss_after"]  # identity growth, no noise: exact
    assert items["export"]["device"] == "cpu" and items["export"]["max_abs_diff"] <= 1e-4
    assert items["wall_time"]["status"] == "n/a" and items["wall_time"]["seconds"] > 0
    assert not list((tmp_path / "runs").iterdir()), "the runs are removed"
    refused = cli(tmp_path, "bench", "--gpu", "--only", "train,nope", expect=2)
    assert "bench --gpu --only" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
