"""Refactorings change no result: fixed runs reproduce their recorded per-step losses bitwise (CPU).

The golden files (``tests/golden/``) are recorded by ``python -m tests.golden_losses``; see that module for the
cases."""

from __future__ import annotations

import json

import pytest

from tests.golden_losses import CASES, golden_path, run_case


@pytest.mark.parametrize("name", list(CASES))
def test_losses_match_golden_bitwise(name, tmp_path):
    want = json.loads(golden_path(name).read_text())
    got = run_case(name, tmp_path)
    assert got["overrides"] == want["overrides"], "the case changed: re-record it on purpose"
    for metric, steps in want["metrics"].items():
        assert steps, f"{metric}: empty golden"
        assert got["metrics"][metric] == steps, f"{name} {metric} differs from the golden file:\n" + "\n".join(
            f"  step {s}: golden {float.fromhex(v)!r} got {float.fromhex(got['metrics'][metric].get(s, 'nan'))!r}"
            for s, v in steps.items()
            if got["metrics"][metric].get(s) != v
        )
