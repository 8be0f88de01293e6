"""The typed manifest (``pretrain/checkpoint/manifest.py``): old manifests parse and round-trip."""

from __future__ import annotations

import json

import pytest

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store as ck
from pretrain.checkpoint.manifest import FORMAT_DEEPSPEED, Manifest
from tests.conftest import FIXTURES

FIXTURE = FIXTURES / "old_checkpoint" / "step_00000002"


def test_old_manifest_parses_and_round_trips():
    """A manifest written before the typed schema (the fixture's): every field read, the format is DeepSpeed engine
    state, and nothing is lost when it is written back."""
    raw = json.loads((FIXTURE / ly.MANIFEST).read_text())
    assert "format" not in raw
    m = ck.read_manifest(FIXTURE)
    assert (m.step, m.world_size, m.format, m.global_sequences) == (2, 1, FORMAT_DEEPSPEED, 16)
    assert m.files[ly.data_file(0)].bytes == (FIXTURE / ly.data_file(0)).stat().st_size
    assert {k: v for k, v in m.to_dict().items() if k != "format"} == raw
    ck.verify(FIXTURE, m)
    assert Manifest.from_dict({**raw, "future_key": 1}).to_dict()["future_key"] == 1
    with pytest.raises(ValueError, match="unknown checkpoint format 'zip'"):
        Manifest.from_dict({**raw, "format": "zip"})
