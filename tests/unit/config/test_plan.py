"""ZeRO data parallelism, the plan's side: dropout seeds follow the global micro-batch, whatever the worker count."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("streams, global_batch, micro", [(2, 8, 4), (4, 8, 2), (8, 16, 2), (8, 16, 1)])
def test_micro_batch_ids_do_not_depend_on_worker_count(streams, global_batch, micro):
    """Dropout seeds are per global micro-batch: the same micro-batch gets the same id on any worker count."""
    from pretrain.config import load_config, make_plan

    cfg = load_config(
        None,
        [f"data.num_streams={streams}", f"train.global_batch_size={global_batch}", f"train.micro_batch_size={micro}"],
    )

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
