"""DeepSpeed ZeRO correctness with real gloo processes: the stage does not change the trajectory,
and 2 workers equal 1 process fed the same global batches."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed

pytestmark = pytest.mark.slow
STEPS, GLOBAL, MICRO = 5, 8, 4


def _cfg(stage: int, world: int):
    from pretrain.config import load_config

    return load_config(None, [
        "model.vocab_size=101", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
        "model.max_seq_len=16", "model.dropout=0.0", f"zero.stage={stage}", f"cluster.num_workers={world}",
        f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={MICRO}", "data.num_streams=2",
        "train.lr=1e-2", "train.warmup_steps=1", f"train.max_steps={STEPS}", "train.precision=fp32",
        "train.seed=3"])


def _global_batches():
    """Learnable sequences (counting from a random start) so the loss visibly drops."""
    g = torch.Generator().manual_seed(7)
    starts = [torch.randint(0, 101, (GLOBAL, 1), generator=g) for _ in range(STEPS)]
    return [(s + torch.arange(16)) % 101 for s in starts]


def _train(rank: int, world: int, stages: list[int]) -> dict[int, list[float]]:
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    out = {}
    for stage in stages:
        cfg = _cfg(stage, world)
        module = build_module(cfg)
        # 2 workers: 4 sequences each, one micro-batch of 4; 1 process: the whole global batch in 2 of 4.
        assert module.plan.micro_batch == MICRO and module.plan.shares == (GLOBAL // world,) * world
        per = GLOBAL // world
        losses = []
        for step, ids in enumerate(_global_batches()):
            shard = ids[rank * per:(rank + 1) * per]
            r = run_step(module, StepInput(step + 1, {"input_ids": shard, "labels": shard}, module.lr_at(step)))
            losses.append(r.loss)
        out[stage] = losses
    return out


def test_zero_stages_agree_and_match_single_process():
    two = run_distributed(_train, 2, [1, 2, 3])
    one = run_distributed(_train, 1, [1])
    assert two[0] == two[1], "ranks must report the same (all-reduced) loss"
    ref = two[0][1]
    print("\nZeRO-1 (2 workers):", [f"{x:.6f}" for x in ref])
    for stage in (2, 3):
        diff = max(abs(a - b) for a, b in zip(ref, two[0][stage]))
        print(f"ZeRO-{stage} vs ZeRO-1 max |diff| = {diff:.2e}")
        assert diff < 1e-5
    diff = max(abs(a - b) for a, b in zip(ref, one[0][1]))
    print(f"2 workers vs 1 process (same global batches) max |diff| = {diff:.2e}")
    assert diff < 1e-4
    assert ref[-1] < ref[0] - 0.2, "training must reduce the loss"


@pytest.mark.parametrize("streams, global_batch, micro", [(2, 8, 4), (4, 8, 2), (8, 16, 2), (8, 16, 1)])
def test_micro_batch_ids_do_not_depend_on_worker_count(streams, global_batch, micro):
    """Dropout seeds are per global micro-batch: the same micro-batch gets the same id on any worker count."""
    from pretrain.config import load_config, make_plan

    cfg = load_config(None, [f"data.num_streams={streams}", f"train.global_batch_size={global_batch}",
                             f"train.micro_batch_size={micro}"])

    def owner_map(world):  # micro-batch id -> the stream its sequences come from
        plan = make_plan(cfg, world)
        assert plan.micro_batch == micro
        out = {}
        per_stream = global_batch // streams // micro
        for rank in range(world):
            owned = [s for s in range(streams) if s % world == rank]
            for j, mid in enumerate(plan.micro_batch_ids(rank)):
                out[mid] = (owned[j // per_stream], j % per_stream)
        return out
    single = owner_map(1)
    assert sorted(single) == list(range(global_batch // micro))
    for world in (2, streams):
        if streams % world == 0 and global_batch // world % micro == 0:
            assert owner_map(world) == single
