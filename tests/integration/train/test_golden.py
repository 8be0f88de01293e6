"""Refactorings change no result: fixed runs reproduce their recorded per-step losses bitwise (CPU).

The golden files (``tests/golden/``) are recorded by ``python -m tests.golden_losses``; see that module for the
cases, the pinned kernels, and the comparison on a machine whose pinned kernels round differently."""

from __future__ import annotations

import json

import pytest

from tests.golden_losses import CASES, OTHER_KERNELS_RTOL, golden_path, recording_for, run_case


@pytest.mark.parametrize("name", list(CASES))
def test_losses_match_golden_bitwise(name, tmp_path):
    want = json.loads(golden_path(name).read_text())
    got = run_case(name, tmp_path)
    assert got["overrides"] == want["overrides"], "the case changed: re-record it on purpose"
    recorded, bitwise = recording_for(want, got)
    if not bitwise:
        print(
            f"\n{name}: recorded on another machine, whose pinned kernels may round differently (fingerprint "
            f"{got['kernels']}, recorded {want['kernels']}; machine {got['machine']}, recorded "
            f"{want.get('machine')}): compared within {OTHER_KERNELS_RTOL:g} relative"
        )
    for metric, steps in recorded.items():
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


def test_each_machine_is_compared_with_its_own_recording():
    """A file recorded before machines were named is bitwise for any machine of its fingerprint; one that names its
    machine, for that machine; a machine's own recording (``other_machines``) wins; anything else: within rtol."""
    file = {"kernels": "k", "metrics": {"m": 1}, "other_machines": {"b": {"kernels": "k", "metrics": {"m": 2}}}}
    assert recording_for(file, {"kernels": "k", "machine": "a"}) == ({"m": 1}, True)
    assert recording_for(file, {"kernels": "k", "machine": "b"}) == ({"m": 2}, True)
    assert recording_for(file, {"kernels": "x", "machine": "b"}) == ({"m": 1}, False)
    assert recording_for({**file, "machine": "c"}, {"kernels": "k", "machine": "a"}) == ({"m": 1}, False)
