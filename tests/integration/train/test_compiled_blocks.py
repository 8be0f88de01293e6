"""``train.compile``: regional compilation of the blocks (inductor's C++ kernels built for each: seconds a test) gives
the eager losses (fp32, within 1e-5 relative), layer dropout's changing decisions do not recompile, growth recompiles
only new block shapes, the health probe's steps recompile nothing. The compiled training job on 2 workers (resume
exact) is in ``test_compile.py``; which setting compiles is a unit test (``tests/unit/model/test_compile.py``)."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import GrowthStep, load_config
from pretrain.model import build_model, param_groups
from pretrain.model.compile import compile_blocks, is_compiled
from pretrain.model.growth import apply_growth
from pretrain.model.layerdrop import training_gates
from tests.harness import tiny_model

SMALL = [*tiny_model(num_layers=3, num_kv_heads=2, dropout=0.0), "train.precision=fp32"]


def compile_counters() -> dict[str, int]:
    """Dynamo's process-wide counts: ``graphs`` compiled so far and ``recompiles`` (a guard failed and a cached
    graph was compiled again for new inputs)."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "recompiles": int(sum(counters["recompiles"].values()))}


def _cfg(*extra: str):
    return load_config(None, SMALL + list(extra))


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 101, (4, 1), generator=g) + torch.arange(16)) % 101 for _ in range(n)]  # learnable


def _train(model, steps: int, gates_of=None) -> list[float]:
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3)
    losses = []
    for step, ids in enumerate(_batches(steps)):
        gates = gates_of(step) if gates_of else None
        loss = model(ids, labels=ids, gates=gates).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            "model.kind=encoder",
            "model.norm_placement=post",
            "model.position=learned",
            "model.bias=true",
            "model.norm=layernorm",
        ],
        ["moe.num_experts=4", "moe.top_k=2", "model.activation=swiglu"],
    ],
)
def test_compiled_blocks_train_like_eager(extra):
    """20 AdamW steps: decoder, encoder and MoE decoder, compiled blocks vs eager."""
    torch._dynamo.reset()
    cfg = _cfg(*extra)
    eager = _train(build_model(cfg.model, 0, cfg.moe), 20)
    model = build_model(cfg.model, 0, cfg.moe)
    assert compile_blocks(model) == 3 and is_compiled(model)
    compiled = _train(model, 20)
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert compiled[-1] < compiled[0]


@pytest.mark.parametrize(
    "drop",
    [
        ["layer_drop.granularity=sublayer", "layer_drop.schedule=progressive"],
        [
            "layer_drop.mode=sample",
            "layer_drop.by_depth=linear",
            "layer_drop.schedule=linear",
            "layer_drop.warmup_steps=10",
        ],
    ],
)
def test_layer_drop_does_not_recompile_every_step(drop):
    """The drop pattern and the scale change every step (progressive / linear schedules): after the few variants
    of a block (attention and/or FFN skipped) are compiled, later steps compile nothing."""
    torch._dynamo.reset()
    cfg = _cfg("layer_drop.rate=0.5", *drop)
    ld = cfg.layer_drop
    model = build_model(cfg.model, 0, cfg.moe)
    compile_blocks(model)
    eager = build_model(cfg.model, 0, cfg.moe)

    def gates_of(step):
        return training_gates(ld, 3, step, cfg.model.num_layers, micro_id=0, batch_size=4)

    base = compile_counters()["graphs"]
    counts = []
    for step in range(24):
        gates = gates_of(step)
        ids = _batches(1)[0]
        model(ids, labels=ids, gates=gates).loss.backward()
        counts.append(compile_counters()["graphs"] - base)
    print("graphs compiled after each step:", counts)
    assert counts[-1] == counts[8], f"graphs compiled per step: {counts}"
    assert counts[-1] <= 4, counts
    model.zero_grad(set_to_none=True)
    assert _train(model, 6, gates_of) == pytest.approx(_train(eager, 6, gates_of), rel=1e-5)


def test_growth_recompiles_only_new_block_shapes():
    """Depth growth keeps the block shapes: nothing new is compiled; width growth compiles one new block graph."""
    torch._dynamo.reset()
    cfg = _cfg()
    model = build_model(cfg.model, 0, cfg.moe)
    compile_blocks(model)
    ids = _batches(1)[0]
    model(ids, labels=ids).loss.backward()
    base = compile_counters()["graphs"]
    deeper = apply_growth(cfg.model, cfg.moe, model.state_dict(), GrowthStep(depth="2x", noise=0.0), 0)
    grown = build_model(deeper.model, 0, deeper.moe)
    grown.load_state_dict(deeper.state)
    assert compile_blocks(grown) == 6
    grown(ids, labels=ids).loss.backward()
    assert compile_counters()["graphs"] == base, "same block shapes: the compiled graphs are reused"
    wider = apply_growth(deeper.model, deeper.moe, deeper.state, GrowthStep(width="2x", noise=0.0), 0)
    wide = build_model(wider.model, 0, wider.moe)
    wide.load_state_dict(wider.state)
    compile_blocks(wide)
    wide(ids, labels=ids).loss.backward()
    assert base < compile_counters()["graphs"] <= 2 * base


def test_health_probe_steps_run_eagerly_and_recompile_nothing():
    """The probe's hooks and its logit flag would change a compiled block's guards on every probed step; its
    forward runs eagerly instead, with the same probe readings, and the compiled graphs stay as they were."""
    from types import SimpleNamespace

    from pretrain.parallel.dims import ParallelDims
    from pretrain.train.health import HealthProbe

    torch._dynamo.reset()
    cfg = _cfg()
    model = build_model(cfg.model, 0, cfg.moe)
    compile_blocks(model)
    ids = _batches(1)[0]
    model(ids, labels=ids).loss.backward()  # compiled: forward and backward graphs
    before = compile_counters()
    readings = []
    for _ in range(3):  # probed steps between plain ones
        probe = HealthProbe(SimpleNamespace(module=model), ParallelDims())
        probe.attach()
        out = model(ids, labels=ids)
        probe.detach(out)
        out.loss.backward()
        readings.append(dict(probe.maxes))
        model(ids, labels=ids).loss.backward()
    assert compile_counters() == before, (before, compile_counters())
    assert readings[0] and all(r.keys() == readings[0].keys() for r in readings)
    assert "attn_logit_max/block00" in readings[0] and "act_max/block02" in readings[0]
