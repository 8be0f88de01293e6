"""``ParallelDims``: the degrees, the rank mapping ``rank = (d * N + s) * M + t``, the expert mapping and the group
layouts (the process groups themselves are created in the gloo tests of
tests/integration/parallel/test_model_parallel.py)."""

from __future__ import annotations

import itertools

import pytest

from pretrain.config import load_config, make_plan
from pretrain.parallel.dims import ParallelDims
from tests.harness import TINY_MODEL

BASE = (*TINY_MODEL, "data.num_streams=2", "train.global_batch_size=8", "train.micro_batch_size=4")


def test_degrees():
    d = ParallelDims(world=16, sequence=2, tensor=2, expert=4)
    assert (d.model_parallel, d.data, d.zero, d.enabled) == (4, 4, 8, True)
    assert ParallelDims(world=3).data == 3 and not ParallelDims(world=3).enabled
    assert d.describe() == "4 data x 2 sequence x 2 tensor parallel"


@pytest.mark.parametrize(("world", "n", "m"), [(1, 1, 1), (4, 2, 1), (4, 1, 2), (8, 2, 2), (12, 3, 2), (12, 2, 3)])
def test_rank_mapping_is_a_bijection(world, n, m):
    d = ParallelDims(world=world, sequence=n, tensor=m)
    seen = set()
    for data, s, t in itertools.product(range(d.data), range(n), range(m)):
        r = d.rank(data, s, t)
        assert r == (data * n + s) * m + t
        assert (d.data_rank(r), d.sequence_rank(r), d.tensor_rank(r)) == (data, s, t)
        assert d.shares_data(r) == (s == 0 and t == 0)
        seen.add(r)
    assert seen == set(range(world))


def test_groups_partition_the_ranks():
    d = ParallelDims(world=8, sequence=2, tensor=2, expert=4)
    assert d.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.sequence_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # the N ranks of one (d, t), M apart
    assert d.expert_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [d.expert_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [d.expert_data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    for groups in (d.tensor_groups(), d.sequence_groups(), d.expert_groups()):
        assert sorted(r for g in groups for r in g) == list(range(8))
    for group in d.sequence_groups():  # one sequence: same data and tensor index, every slice once
        assert {(d.data_rank(r), d.tensor_rank(r)) for r in group} == {(d.data_rank(group[0]), d.tensor_rank(group[0]))}
        assert [d.sequence_rank(r) for r in group] == list(range(d.sequence))


def test_the_plan_holds_the_dims_built_from_the_config():
    cfg = load_config(None, [*BASE, "cluster.num_workers=8", "parallel.sequence=2", "parallel.tensor=2"])
    dims = make_plan(cfg, 8).dims
    assert dims == ParallelDims(world=8, sequence=2, tensor=2, expert=1)
    moe = load_config(None, [*BASE, "moe.num_experts=4", "zero.stage=1", "cluster.num_workers=2", "parallel.expert=2"])
    assert make_plan(moe, 2).dims == ParallelDims(world=2, expert=2)
    dense = load_config(None, [*BASE, "parallel.expert=2"])  # the expert degree counts for an MoE model only
    assert make_plan(dense, 1).dims == ParallelDims(world=1)


def test_a_plan_without_dims_is_data_parallel():
    from pretrain.config import layout

    plan = layout(world_size=2, global_batch=8, micro_cap=4, num_streams=2, seq_len=16)
    assert plan.dims == ParallelDims(world=2) and plan.workers == 2 and plan.model_parallel == 1
