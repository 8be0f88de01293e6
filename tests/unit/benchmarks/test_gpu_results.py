"""The GPU check's results file (``benchmarks/gpu_results.py``): its name, its rows, and never over an earlier
one."""

from __future__ import annotations

import time

from benchmarks.gpu_check import item
from benchmarks.gpu_results import results_markdown, results_name, write_new


def test_results_file_name_and_rows(tmp_path):
    result = {
        "device": "NVIDIA H100 80GB HBM3",
        "tiny": False,
        "torch": "2.11.0+cu130",
        "passed": False,
        "items": {"mfu": item("fail", "41.0%", seconds=1.0), "export": item("pass", "a | b")},
    }
    assert results_name(result) == time.strftime("%Y-%m-%d", time.gmtime()) + "-h100-80gb-hbm3.md"
    text = results_markdown(result, "./launch.sh bench --gpu --json")
    assert "| `mfu` | fail | 41.0% | 1.0 |" in text and "| `export` | pass | a / b |  |" in text
    assert "Overall: FAILED" in text and "NVIDIA H100 80GB HBM3" in text
    # a second check the same day never writes over the first's file, nor the notes added to it
    first = write_new(tmp_path / "results", "2026-01-02-h100.md", text)
    first.write_text(text + "notes")
    assert write_new(tmp_path / "results", "2026-01-02-h100.md", "again").name == "2026-01-02-h100-2.md"
    assert write_new(tmp_path / "results", "2026-01-02-h100.md", "third").name == "2026-01-02-h100-3.md"
    assert first.read_text() == text + "notes"
