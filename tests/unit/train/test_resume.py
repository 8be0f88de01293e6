"""What a resume must convert (``pretrain/train/resume.py``)."""

from __future__ import annotations

import torch


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


def test_a_resume_after_an_upcycling_growth_takes_the_checkpoints_architecture_and_a_layout_that_fits(tmp_path):
    """A dense run that grew into experts resumes with the grown model and MoE sections; expert parallelism stays as
    configured where the saved expert count allows it, else 1 (as the growth set it), and the plan follows."""
    from pretrain.checkpoint import store as ckpt_io
    from pretrain.checkpoint.manifest import Manifest
    from pretrain.config import dump_yaml, load_config, make_plan
    from pretrain.train.resume import checkpoint_architecture

    dense = [
        "model.activation=swiglu",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "cluster.num_workers=4",
    ]
    for ep, experts, resumed_ep in ((2, 4, 2), (4, 6, 1)):
        cfg = load_config(None, [*dense, f"parallel.expert={ep}"])
        grown = load_config(
            None, [*dense, f"moe.num_experts={experts}", "moe.top_k=2", f"parallel.expert={resumed_ep}"]
        )
        (tmp_path / "config.yaml").write_text(dump_yaml(grown))
        out = checkpoint_architecture(cfg, ckpt_io.CommittedCheckpoint(tmp_path, 5, Manifest(step=5)))
        assert (out.moe.num_experts, out.moe.top_k, out.parallel.expert) == (experts, 2, resumed_ep)
        assert make_plan(out, 4).dims.expert == resumed_ep and make_plan(cfg, 4).dims.expert == 1


def test_a_resume_of_a_growth_run_takes_the_grown_shape_from_the_checkpoint_and_the_rest_from_the_resume(tmp_path):
    """What growth changed (depth, width) comes from the checkpoint; what it never changes (dropout, z-loss, the
    MoE loss weights) is what the resume asked, as in a run without a growth schedule."""
    from pretrain.checkpoint import store as ckpt_io
    from pretrain.checkpoint.manifest import Manifest
    from pretrain.config import dump_yaml, load_config
    from pretrain.train.resume import checkpoint_architecture

    base = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.activation=swiglu"]
    grown = load_config(None, [*base, "model.num_layers=4", "moe.num_experts=4", "moe.aux_loss_weight=0.01"])
    (tmp_path / "config.yaml").write_text(dump_yaml(grown))
    asked = load_config(None, [*base, "model.dropout=0.3", "model.z_loss=0.01", "moe.aux_loss_weight=0.05"])
    out = checkpoint_architecture(asked, ckpt_io.CommittedCheckpoint(tmp_path, 5, Manifest(step=5)))
    assert (out.model.num_layers, out.moe.num_experts) == (4, 4)
    assert (out.model.dropout, out.model.z_loss, out.moe.aux_loss_weight) == (0.3, 0.01, 0.05)


def _resume_point(rank: int, world: int, run_dir: str, hidden: bool = False) -> int | str:
    """``find_resume_point`` where rank 1's listing of the run directory lags (it sees step 2, rank 0 step 4);
    ``hidden``: rank 1 cannot open step 4 at all. The step resumed, or the error."""
    from pathlib import Path

    from pretrain.checkpoint import store
    from pretrain.config import load_config
    from pretrain.train import dist
    from pretrain.train.resume import find_resume_point

    listed, resolve = store.latest_committed, store.resolve

    def lagging(path, full=True):
        if hidden and Path(path).name == "step_00000004":
            raise store.CheckpointError(f"{path}: no such checkpoint")
        return resolve(path, full=full)

    if rank == 1:
        store.latest_committed = lambda d, full=True: resolve(Path(d) / "step_00000002", full=full)
        store.resolve = lagging
    try:
        ctx = dist.DistContext(rank, world, rank, world, torch.device("cpu"), False)
        return find_resume_point(load_config(None, []), Path(run_dir), ctx).step
    except store.CheckpointError as e:
        return str(e)
    finally:
        store.latest_committed, store.resolve = listed, resolve


def test_every_rank_resumes_the_checkpoint_rank_0_chose(tmp_path):
    """A rank whose listing of a shared run directory lags behind a commit (NFS caches listings) takes rank 0's
    choice: every rank restores the same step (it restored its own: different weights and counters, a hang); one
    that cannot open it at all says so on every rank (the others would wait for it in the next collective)."""
    from tests.harness import run_distributed
    from tests.unit.checkpoint.test_store import _commit

    for step in (2, 4):
        _commit(tmp_path, step)
    assert run_distributed(_resume_point, 2, str(tmp_path), fresh=False) == [4, 4]
    said = run_distributed(_resume_point, 2, str(tmp_path), True, fresh=False)
    assert said[0] == said[1] and said[0].startswith("rank 1: ") and "step_00000004: no such checkpoint" in said[0]
