"""DeepSpeed ZeRO correctness with real gloo processes: the stage (and offloading the optimizer) does not change the
trajectory, and 2 workers equal 1 process fed the same global batches. The cases are a table of config overrides run
once (one set of processes per world size); each row is checked against its reference row."""

from __future__ import annotations

import pytest

from tests.harness import Case, case_ids, learnable_batches, run_cases, step_losses

STEPS, GLOBAL, MICRO = 5, 8, 4
COMMON = (
    "model.dropout=0.0",
    f"train.global_batch_size={GLOBAL}",
    f"train.micro_batch_size={MICRO}",
    "data.num_streams=2",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    f"train.max_steps={STEPS}",
    "train.precision=fp32",
    "train.seed=3",
)
CASES = [
    Case("zero1-2w", ("zero.stage=1",), 2),
    Case("zero2-2w", ("zero.stage=2",), 2),
    Case("zero3-2w", ("zero.stage=3",), 2),
    Case("zero1-offload-2w", ("zero.stage=1", "zero.offload_optimizer=true"), 2),  # torch's fused AdamW on the host
    Case("zero3-offload-2w", ("zero.stage=3", "zero.offload_optimizer=true"), 2),
    Case("zero1-1w", ("zero.stage=1",), 1),  # 1 process: the whole global batch in 2 micro-batches of 4
]
# case -> (the case it must equal, max |loss difference| over the steps)
MATCHES = {
    "zero2-2w": ("zero1-2w", 1e-5),
    "zero3-2w": ("zero1-2w", 1e-5),
    "zero1-offload-2w": ("zero1-2w", 1e-5),
    "zero3-offload-2w": ("zero1-2w", 1e-5),
    "zero1-1w": ("zero1-2w", 1e-4),
}


def _train(rank: int, world: int, overrides: list[str]) -> list[float]:
    def check(module) -> None:  # 2 workers: 4 sequences each, one micro-batch of 4; 1 process: 2 micro-batches of 4
        assert module.plan.micro_batch == MICRO and module.plan.shares == (GLOBAL // world,) * world

    return step_losses(rank, world, [*COMMON, *overrides], learnable_batches(STEPS, GLOBAL), check=check)


@pytest.fixture(scope="module")
def runs():
    return run_cases(_train, CASES)


@pytest.mark.parametrize("case", CASES, ids=case_ids(CASES))
def test_zero_stages_agree_and_match_single_process(runs, case):
    """Every rank reports the same (all-reduced) losses, training reduces them, and the row equals its reference:
    ZeRO-2 and ZeRO-3 equal ZeRO-1 (1e-5), so do ZeRO-1 and ZeRO-3 with the optimizer offloaded to the host, and 2
    workers equal 1 process fed the same global batches (1e-4)."""
    ranks = runs[case.id]
    assert all(r == ranks[0] for r in ranks), "ranks must report the same (all-reduced) loss"
    losses = ranks[0]
    print(f"\n{case.id}:", [f"{x:.6f}" for x in losses])
    assert losses[-1] < losses[0] - 0.2, "training must reduce the loss"
    if case.id in MATCHES:
        ref, tol = MATCHES[case.id]
        diff = max(abs(a - b) for a, b in zip(runs[ref][0], losses))
        print(f"{case.id} vs {ref} max |diff| = {diff:.2e}")
        assert diff < tol
