"""What a resume must convert (``pretrain/train/resume.py``)."""

from __future__ import annotations


def test_expert_parallel_state_of_another_layout_is_converted(tmp_path):
    """Expert-parallel engine state resumes on another expert degree or worker count through its full form; the same
    layout, dense checkpoints, expert degree 1 on both sides (elastic like a dense model) and full weights need none."""
    from pretrain.checkpoint import store as ckpt_io
    from pretrain.checkpoint.manifest import Manifest
    from pretrain.train.resume import expert_layout_changed

    def ckpt(world, ep, fmt="deepspeed"):
        return ckpt_io.CommittedCheckpoint(tmp_path, 8, Manifest(step=8, world_size=world, moe_ep_size=ep, format=fmt))

    assert not expert_layout_changed(ckpt(2, 2), 2, 2)
    assert not expert_layout_changed(ckpt(2, 1), 1, 1)
    assert not expert_layout_changed(ckpt(2, 0), 0, 1)
    assert not expert_layout_changed(ckpt(1, 2, "full"), 2, 4)
    assert expert_layout_changed(ckpt(2, 2), 1, 2)
    assert expert_layout_changed(ckpt(2, 2), 2, 4)
    assert expert_layout_changed(ckpt(1, 1), 2, 2)
