"""Conversions cached beside a run's checkpoints (``pretrain/checkpoint/weights.py``): the DeepSpeed universal form
is keyed by the checkpoint's manifest, so a new checkpoint of a step (committed after a rollback abandoned the old
one) is converted anew. The conversion itself on real ranks: elastic resume in
``tests/integration/checkpoint/test_checkpoint.py``."""

from __future__ import annotations

import os

from pretrain.checkpoint import layout as ly
from pretrain.checkpoint import store as ck
from pretrain.checkpoint import weights
from pretrain.checkpoint.manifest import Manifest


def _commit(run_dir, step: int, tokens_seen: int) -> ck.CommittedCheckpoint:
    stage = ly.staging_dir(run_dir, step, ck.new_nonce())
    (stage / ly.DS_DIR / ly.DS_TAG).mkdir(parents=True)
    (stage / ly.DS_DIR / ly.DS_TAG / "model.pt").write_bytes(os.urandom(100))
    ck.write_json(stage / ly.data_file(0), {})
    return ck.open_committed(ck.commit(stage, run_dir, Manifest(step=step, world_size=1, tokens_seen=tokens_seen)))


def test_the_universal_form_is_cached_per_checkpoint_not_per_step(tmp_path, monkeypatch):
    converted = []

    def convert(src, dst):  # DeepSpeed's conversion, reduced to what says which checkpoint it read
        converted.append(src)
        dst.mkdir(parents=True)
        (dst / "from").write_bytes((src / "model.pt").read_bytes())

    monkeypatch.setattr(weights.ds_adapter, "convert_to_universal", convert)
    run = tmp_path / "run"
    old = _commit(run, 5, tokens_seen=50)
    first = weights.universal_checkpoint(old, run)
    assert weights.universal_checkpoint(old, run) == first and len(converted) == 1  # converted once, then cached
    ck.abandon_after(run, 4)  # a rollback to step 4: this step 5 is abandoned, and trained again
    new = _commit(run, 5, tokens_seen=51)
    second = weights.universal_checkpoint(new, run)
    assert second != first and len(converted) == 2
    assert (second / ly.DS_TAG / "from").read_bytes() == (new.path / ly.DS_DIR / ly.DS_TAG / "model.pt").read_bytes()
