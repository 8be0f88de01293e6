"""``pretrain.ds_adapter.weights_only_loads``: DeepSpeed's own checkpoint readers (``zero_to_fp32``,
``ds_to_universal``, the engine's universal and ZeRO-3 loads) call ``torch.load(..., weights_only=False)``; inside
the block those calls unpickle weights only, with the allowlist of the classes DeepSpeed's files hold. The readers
themselves on real ZeRO checkpoints: ``tests/integration/checkpoint/test_export.py`` (ZeRO-2 and 3 consolidated)
and ``tests/integration/train/test_train_e2e.py`` (resume on another worker count, through the universal form)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from pretrain.ds_adapter import weights_only_loads

KEY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


def _touch(path: str) -> str:
    Path(path).write_text("ran")
    return path


class Payload:
    """Unpickling it calls ``_touch``: what a crafted checkpoint file could make ``torch.load`` run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return _touch, (str(self.marker),)


def test_a_load_that_asks_for_full_unpickling_gets_weights_only_in_the_block(tmp_path, monkeypatch):
    from deepspeed.runtime.zero.config import ZeroStageEnum

    monkeypatch.delenv(KEY, raising=False)
    marker = tmp_path / "ran.txt"
    crafted = tmp_path / "crafted.pt"
    torch.save({"module": {"w": torch.ones(2)}, "payload": Payload(marker)}, crafted)
    with weights_only_loads():
        assert os.environ[KEY] == "1"
        with pytest.raises(pickle.UnpicklingError):
            torch.load(crafted, map_location="cpu", weights_only=False)
    assert not marker.exists(), "nothing in the file ran"
    assert KEY not in os.environ, "the variable is as it was"

    # what DeepSpeed's files hold loads in the block: tensors, containers and the allowlisted classes
    ds_like = tmp_path / "optim_states.pt"
    torch.save({"zero_stage": ZeroStageEnum.gradients, "state": {"exp_avg": torch.zeros(3)}}, ds_like)
    with weights_only_loads():
        with torch.serialization.safe_globals([ZeroStageEnum]):  # a nested allowlist (the engine's), then gone
            torch.load(ds_like, map_location="cpu", weights_only=True)
        loaded = torch.load(ds_like, map_location="cpu", weights_only=False)
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and torch.equal(loaded["state"]["exp_avg"], torch.zeros(3))

    # a user's TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD (torch refuses it beside the forcing one) is set aside, then back
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with weights_only_loads():
        assert torch.load(ds_like, map_location="cpu", weights_only=False)["zero_stage"] is ZeroStageEnum.gradients
    assert os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1" and KEY not in os.environ
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")

    # outside the block the caller's choice stands: the same file runs its payload (what the block prevents)
    monkeypatch.setenv(KEY, "0")
    with weights_only_loads():
        pass
    assert os.environ[KEY] == "0"
    torch.load(crafted, map_location="cpu", weights_only=False)
    assert marker.read_text() == "ran"
