"""Refactorings change no result: fixed runs reproduce their recorded per-step losses bitwise (CPU).

The golden files (``tests/golden/``) are recorded by ``python -m tests.golden_losses``; see that module for the
cases, the pinned kernels, and the comparison on a machine whose pinned kernels round differently."""

from __future__ import annotations

import json

import pytest

from tests.golden_losses import CASES, OTHER_KERNELS_RTOL, golden_path, run_case


@pytest.mark.parametrize("name", list(CASES))
def test_losses_match_golden_bitwise(name, tmp_path):
    want = json.loads(golden_path(name).read_text())
    got = run_case(name, tmp_path)
    assert got["overrides"] == want["overrides"], "the case changed: re-record it on purpose"
    bitwise = got["kernels"] == want["kernels"] and want.get("machine", got["machine"]) == got["machine"]
    if not bitwise:
        print(
            f"\n{name}: recorded on another machine, whose pinned kernels may round differently (fingerprint "
            f"{got['kernels']}, recorded {want['kernels']}; machine {got['machine']}, recorded "
            f"{want.get('machine')}): compared within {OTHER_KERNELS_RTOL:g} relative"
        )
    for metric, steps in want["metrics"].items():
        assert steps, f"{metric}: empty golden"
        assert sorted(got["metrics"][metric]) == sorted(steps), f"{name} {metric}: other steps logged"
        differ = {
            s: (float.fromhex(v), float.fromhex(got["metrics"][metric][s]))
            for s, v in steps.items()
            if got["metrics"][metric][s] != v
            and (bitwise or abs(float.fromhex(got["metrics"][metric][s]) / float.fromhex(v) - 1) > OTHER_KERNELS_RTOL)
        }
        assert not differ, f"{name} {metric} differs from the golden file:\n" + "\n".join(
            f"  step {s}: golden {want_!r} got {got_!r}"
            for s, (want_, got_) in sorted(differ.items(), key=lambda x: int(x[0]))
        )
