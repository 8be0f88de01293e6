"""The plan before a GPU job: ``train --dry-run`` of every preset on this machine (no GPU, two CPUs, no network) at
cluster scale, and the memory formulas of ``pretrain/driver/memory_plan.py`` against numbers worked out by hand.
The estimate against memory measured while training is ``tests/integration/train/test_memory_plan.py``."""

from __future__ import annotations

import socket
import time
from dataclasses import replace

import pytest

from pretrain.cli import main
from pretrain.config import ConfigError, load_config, make_plan
from pretrain.config.runtime import GPU_MEMORY_GIB
from pretrain.driver.memory_plan import (
    ParamCounts,
    activations,
    count_parameters,
    layout_of,
    memory,
)
from tests.conftest import ROOT
from tests.harness import tiny_model

PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("demo-cache")  # the demo corpus, built once for all presets


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dry run tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("workers", [16, 64])
@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_dry_run_plans_every_preset_at_scale_offline(preset, workers, workdir, demo_cache, no_network, capsys):
    """use_gpu yes on a machine without a GPU driver, 16 or 64 workers of 8 CPUs on 2 CPUs, hub datasets that
    cannot be reached: the plan is printed (exit 0), each check left out said in one line."""
    batch = load_config(preset).train.global_batch_size
    args = [
        "cluster.use_gpu=yes",
        f"cluster.num_workers={workers}",
        "cluster.cpus_per_worker=8",
        "cluster.gpu_type=H100-80GB",
        "data.num_streams=64",
        f"train.global_batch_size={-(-batch // 64) * 64}",
        "train.val_sequences=512",
        f"data.cache_dir={demo_cache}",
    ]
    start = time.monotonic()
    assert main(["train", str(preset), *args, "--dry-run"]) == 0, capsys.readouterr().err
    assert time.monotonic() - start < 5
    out = capsys.readouterr().out
    assert "not checked: gpu: a GPU driver for cluster.use_gpu=yes (dry run" in out
    assert f"not checked: workers: room for {workers} workers x 8 CPU(s)" in out
    if "hub" in preset.read_text():
        assert "not checked: data: hub dataset HuggingFaceFW/fineweb-edu not opened (dry run: no network)" in out
    nodes = workers // 8
    assert f"parallel     {nodes} node(s) x 8 GPU(s) (cluster.gpus_per_node=8); data parallel {workers}" in out
    assert "tensor 1 x sequence 1 x expert" in out and "parameters   " in out and "tokens/step" in out
    assert "memory       " in out and "GiB per GPU at the step's peak: bf16, ZeRO-" in out
    for part in ("weights", "gradients", "optimizer", "activations"):
        assert f" {part:<12} " in out
    assert "verdict      H100-80GB: fits: " in out or "verdict      H100-80GB: does not fit: " in out


def test_a_cpu_plan_has_no_verdict(workdir, demo_cache, capsys):
    assert main(["train", f"data.cache_dir={demo_cache}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "parallel     1 CPU worker(s); data parallel 1" in out
    assert "GiB per worker (host memory) at the step's peak: fp32, ZeRO-1" in out and "\n  verdict " not in out
    assert "not checked" not in out  # one worker in this process, the demo corpus: everything was checked


def test_an_unknown_gpu_type_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["cluster.gpu_type=H100"])
    assert str(e.value) == (
        f"cluster.gpu_type: 'H100' is not a known GPU (known: {', '.join(GPU_MEMORY_GIB)}; empty for no memory verdict)"
    )
    with pytest.raises(ConfigError, match="cluster.gpus_per_node: must be > 0"):
        load_config(None, ["cluster.gpus_per_node=0"])


SMALL = [
    *tiny_model(
        kind="decoder",
        norm="rmsnorm",
        norm_placement="pre",
        activation="swiglu",
        position="rotary",
        hidden_size=64,
        num_kv_heads=2,
        ffn_size=128,
        vocab_size=256,
        max_seq_len=32,
        tie_embeddings=False,
    ),
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "cluster.num_workers=4",
    "cluster.cpus_per_worker=0.5",
    "data.num_streams=4",
    "zero.reduce_bucket_size=1000",
]


def test_the_formulas_against_hand_computed_numbers():
    cfg = load_config(None, [*SMALL, "cluster.use_gpu=yes"])
    counts = count_parameters(cfg)
    # embedding and untied head 256*64 each; a block: 2 norms of 64, q and o 64*64, k and v 64*32, FFN 3*64*128;
    # the final norm 64
    block = 2 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128
    assert counts.total == 2 * 256 * 64 + 2 * block + 64 == 106_816
    lay = layout_of(cfg, make_plan(cfg, 4))
    assert (lay.precision, lay.stage, lay.dp, lay.micro_batch, lay.seq_len) == ("bf16", 1, 4, 4, 32)
    mem = memory(cfg, counts, lay)
    assert mem.weights == 2 * 106_816  # bf16, whole on every worker under ZeRO-1
    # bf16 ZeRO-1 (DeepSpeed's BF16_Optimizer): the bf16 gradients and their fp32 sum, and the engine's fp32
    # reduction of them all at once (up to 500M elements; not zero.reduce_bucket_size)
    assert mem.gradients == (2 + 4) * 106_816 + 4 * 106_816
    assert mem.optimizer == 12 * 106_816 / 4  # fp32 master + 2 moments, partitioned over 4
    # per token, bf16 (a = 2): an RMSNorm keeps its fp32 input (4*64), normalized input and output (2*64 each), 1/rms
    norm = 4 * 64 + 2 * 64 + 4 + 2 * 64
    # a block: two norms; q, k, v, attention output (2*64 each), fp32 log-sum-exp per head; SwiGLU 4 x 2*128
    blk = 2 * norm + 4 * 2 * 64 + 4 * 4 + 4 * 2 * 128
    assert blk == 2584
    tokens, v = 4 * 32, 256
    logits = v * (2 + 12)  # bf16 logits + fp32 log-softmax, its gradient, the logits' gradient
    acts = activations(cfg.model, cfg.moe, lay)
    # the backward's start: every block, the final norm, the loss; once gradients exist: the logits and the norm
    assert (acts.kept, acts.at_start, acts.with_gradients) == (
        tokens * 2 * blk,
        tokens * (norm + logits),
        tokens * (2 * v + norm),
    )
    # one micro-batch a step: the peak is the larger of the start and the backward with every gradient
    peak = max(tokens * (norm + logits), tokens * (2 * v + norm) + mem.gradients)
    assert mem.total == 2 * 106_816 + 3 * 106_816 + tokens * 2 * blk + peak == 2_395_328
    # a health step's optimizer step: the update ratio copies this worker's quarter of the (bf16) weights, then
    # their differences; the peak where that is larger than the backward's (a large model, small activations)
    assert mem.snapshot == 2 * 2 * 106_816 / 4
    assert replace(mem, snapshot=10**9).total == mem.weights + mem.optimizer + mem.gradients + 10**9
    # full: the blocks keep their input; the last block rebuilt in the backward beside the logits
    full = activations(cfg.model, cfg.moe, replace(lay, recompute="full"))
    rebuilt = tokens * (blk - 2 * 64)
    assert (full.kept, full.with_gradients) == (tokens * 2 * 2 * 64, tokens * 2 * v + rebuilt)
    # selective keeps the block input, q/k/v projections (64 + 2*32), attention output + lse, o_proj, gate/up, down
    sel = 2 * 64 + 2 * (64 + 2 * 32) + 2 * 64 + 4 * 4 + 2 * 64 + 2 * (2 * 128 + 64)
    part = activations(cfg.model, cfg.moe, replace(lay, recompute="selective"))
    assert (part.kept, part.with_gradients) == (tokens * 2 * sel, tokens * (2 * v + blk - sel))
    # gradient accumulation: the earlier micro-batches' gradients are alive at a backward's start
    two = memory(cfg, counts, replace(lay, micro_batch=2, grad_accum=2))
    half = activations(cfg.model, cfg.moe, replace(lay, micro_batch=2))
    # and a health step's probe: the backward's start and the micro-batch's 2 x 32 x 256 logits as one fp32 chunk,
    # copied twice (more than one head's 2 x 32 x 32 fp32 attention scores and their masked copy)
    assert two.probe == half.at_start + 8 * (2 * 32) * 256
    assert two.total == 5 * 106_816 + half.kept + two.gradients + max(half.at_start, half.with_gradients, two.probe)

    # fp32: 4-byte weights and gradients; ZeRO-1/2 clone their fp32 partition (12 B), ZeRO-3 and 0 do not (8 B)
    for stage, opt in ((0, 8 * 106_816), (1, 12 * 106_816 / 4), (2, 12 * 106_816 / 4), (3, 8 * 106_816 / 4)):
        c = load_config(None, [*SMALL, "train.precision=fp32", f"zero.stage={stage}"])
        assert memory(c, counts, layout_of(c, make_plan(c, 4))).optimizer == opt


def test_zero_stages_and_experts_split_the_state():
    counts = ParamCounts(total=1000, body=800, active=600, expert=400, largest_gather=100)
    cfg = load_config(None, [*SMALL, "cluster.use_gpu=yes", "zero.stage=2", "zero.reduce_bucket_size=10"])
    lay = layout_of(cfg, make_plan(cfg, 4))
    lay = replace(lay, ep=2)
    mem = memory(cfg, counts, lay)
    held = 600 + 400 / 2  # dense weights, and half the experts (ep 2)
    assert mem.weights == 2 * held
    assert mem.gradients == 4 * (1000 / 4 + 10)  # fp32 partition + the fp32 reduce bucket (reduce_bucket_size)
    assert mem.optimizer == 12 * 1000 / 4
    # the update ratio's copies on the worker counting the most: a quarter of the dense weights, its experts whole
    assert mem.snapshot == 2 * 2 * (600 / 4 + 400 / 2)
    z3 = memory(cfg, counts, replace(lay, stage=3, ep=1))
    assert z3.weights == 2 * (1000 / 4 + 2 * 100)  # partition + the gathered layer and the prefetched one
