"""Mixture-of-Experts on real gloo ranks: expert parallelism equals replicated experts (EP=2 and EP=4 against
EP=1, a table of config overrides run once), the real train loop with EP=2 (metrics, collapse flag, bitwise resume,
elastic resume of replicated experts, expert layouts changed on resume), consolidation and export, and the CLI with
Ray."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from pretrain.config import MoEConfig, load_config
from pretrain.model import build_model
from pretrain.model.moe import moe_layers, routing_metrics
from tests.conftest import ROOT, in_workdir
from tests.harness import (
    E2E,
    Case,
    case_ids,
    cli,
    learnable_batches,
    metric_history,
    run_cases,
    run_id_of,
    run_jobs,
    tiny_model,
    train_steps,
)
from tests.unit.model.test_moe import GLOBAL, MICRO, STEPS, _small

# ----------------------------------------------------------------------------------------------
# Expert parallelism on real gloo ranks
# ----------------------------------------------------------------------------------------------


def _ep(
    ep: int, k: int, stage: int, cap: float = 0.0, balance: str = "aux_loss", world: int = 2, micro: int = MICRO
) -> Case:
    name = f"ep{ep}-top{k}-z{stage}" + ("-cap1" if cap else "") + ("-bias" if balance == "bias" else "")
    return Case(
        f"{name}-{world}w",
        (
            f"parallel.expert={ep}",
            f"moe.top_k={k}",
            f"zero.stage={stage}",
            f"moe.capacity_factor={cap}",
            f"train.micro_batch_size={micro}",
            f"moe.balance={balance}",
        ),
        world,
    )


EP_CASES = [
    # 2 workers: EP=2 (2 experts each, all-to-all) and EP=1 (all 4 experts on each worker), ZeRO-1/2/3, top-1 and
    # top-2, dropless and with token dropping (capacity 1.0), loss-free balancing (moe.balance=bias)
    _ep(1, 1, 1),
    _ep(2, 1, 1),
    _ep(2, 1, 2),
    _ep(1, 2, 1),
    _ep(2, 2, 1),
    _ep(2, 2, 2),
    _ep(1, 2, 2, 1.0),
    _ep(2, 2, 2, 1.0),
    _ep(1, 2, 3),
    _ep(1, 2, 1, balance="bias"),
    _ep(2, 2, 1, balance="bias"),
    # 4 workers: EP=2 (two expert-data-parallel replicas of each expert: their gradients are reduced over that
    # group only) and EP=4 (one expert per worker)
    _ep(1, 2, 1, world=4, micro=2),
    _ep(2, 2, 1, world=4, micro=2),
    _ep(4, 2, 2, world=4, micro=2),
]
# expert-parallel case -> (the EP=1 case it equals: losses and grad norms within 1e-4, the same health metrics;
# whether the first step's routing counts are compared too)
SAME_AS_REPLICATED = {
    "ep2-top1-z1-2w": ("ep1-top1-z1-2w", True),
    "ep2-top1-z2-2w": ("ep1-top1-z1-2w", True),
    "ep2-top2-z1-2w": ("ep1-top2-z1-2w", True),
    "ep2-top2-z2-2w": ("ep1-top2-z1-2w", True),
    "ep2-top2-z2-cap1-2w": ("ep1-top2-z2-cap1-2w", True),
    "ep2-top2-z1-4w": ("ep1-top2-z1-4w", False),
    "ep4-top2-z2-4w": ("ep1-top2-z1-4w", False),
}


def _train_case(rank: int, world: int, overrides: list[str]) -> list[tuple]:
    """Per step: (loss, grad norm, routing counts per MoE block, health metrics (last step), selection biases)."""
    from pretrain.train.callbacks.health import HealthCallback
    from pretrain.train.health import HealthProbe
    from pretrain.train.module import build_module

    cfg = _small(
        f"cluster.num_workers={world}", f"data.num_streams={world}", "train.seed=3", "moe.bias_rate=0.05", *overrides
    )
    module = build_module(cfg)
    per = GLOBAL // world
    assert module.plan.micro_batch == cfg.train.micro_batch_size and module.plan.shares == (per,) * world
    health = HealthCallback(every=1)
    res = []

    def before(step: int) -> None:
        health.probe = HealthProbe(module.engine, module.plan.dims) if step == STEPS - 1 else None
        health.health = {}

    def after(step: int, r) -> None:
        biases = [
            layer.selection_bias.tolist()
            for _, layer in moe_layers(module.engine.module)
            if layer.selection_bias is not None
        ]
        res.append((r.loss, r.grad_norm, {i: s.tolist() for i, s in r.moe.items()}, health.health, biases))

    train_steps(module, learnable_batches(STEPS, GLOBAL), rank, world, hooks=[health], before=before, after=after)
    return res


@pytest.fixture(scope="module")
def ep_cases():
    return run_cases(_train_case, EP_CASES)


def _same_health(ref: dict, got: dict) -> None:
    """Health metrics (norms per block, update ratios) count every expert once, whatever the expert layout."""
    keys = [k for k in ref if k.startswith(("health/grad_norm", "health/param_norm", "health/update_ratio"))]
    assert "health/param_norm/block01" in keys
    for k in keys:
        assert got[k] == pytest.approx(ref[k], rel=1e-4), k


def _bias_like_replicated(res: dict) -> None:
    """Loss-free balancing: the selection biases, updated from the all-reduced load, are the same for EP=2 and EP=1
    (and on both ranks)."""
    ref, got = res["ep1-top2-z1-bias-2w"][0], res["ep2-top2-z1-bias-2w"][0]
    assert max(abs(a[0] - b[0]) for a, b in zip(ref, got)) < 1e-4
    assert [x[4] for x in ref] == [x[4] for x in got], "EP=2 applies the same bias updates as EP=1"
    assert [x[2] for x in ref][0] == [x[2] for x in got][0] and any(b != 0 for b in ref[0][4][0])
    assert ref[-1][4] != ref[0][4], "the bias moves with the load"


def _aux_loss_keeps_no_bias(res: dict) -> None:
    assert all(not x[4] for x in res["ep1-top2-z1-2w"][0]), "aux_loss keeps no bias"


def _zero3_like_zero1(res: dict) -> None:
    zero3 = max(abs(a[0] - b[0]) for a, b in zip(res["ep1-top2-z1-2w"][0], res["ep1-top2-z3-2w"][0]))
    print(f"ZeRO-3 (parallel.expert=1: experts sharded like dense weights) vs ZeRO-1: max |loss diff| {zero3:.2e}")
    assert zero3 < 1e-5


def _trains(res: dict) -> None:
    got = res["ep2-top2-z1-2w"][0]
    assert got[-1][0] < got[0][0] - 0.2, "training must reduce the loss"


def _drops(res: dict) -> None:
    dropped = routing_metrics({i: torch.tensor(v) for i, v in res["ep2-top2-z2-cap1-2w"][0][0][2].items()})
    assert dropped["moe/block0/dropped_frac"] > 0, "capacity 1.0 drops some assignments"


EXTRA_CHECKS = {
    "ep2-top2-z1-bias-2w": _bias_like_replicated,
    "ep1-top2-z1-2w": _aux_loss_keeps_no_bias,
    "ep1-top2-z3-2w": _zero3_like_zero1,
    "ep2-top2-z1-2w": _trains,
    "ep2-top2-z2-cap1-2w": _drops,
}


@pytest.mark.parametrize("case", EP_CASES, ids=case_ids(EP_CASES))
def test_expert_parallel_equals_replicated_experts(ep_cases, case):
    """Every rank reports the same reduced values; EP=2 and EP=4 equal EP=1 on the same data (losses, grad norms,
    routing counts, health metrics); ZeRO-3 with parallel.expert 1 trains the MoE model like ZeRO-1; loss-free balancing
    gives the same biases for EP=2 and EP=1; capacity 1.0 drops assignments."""
    ranks = ep_cases[case.id]
    assert all(r == ranks[0] for r in ranks), "every rank reports the same reduced values"
    got = ranks[0]
    if case.id in SAME_AS_REPLICATED:
        ref_id, routing = SAME_AS_REPLICATED[case.id]
        ref = ep_cases[ref_id][0]
        loss_diff = max(abs(a[0] - b[0]) for a, b in zip(ref, got))
        norm_diff = max(abs(a[1] - b[1]) for a, b in zip(ref, got))
        print(
            f"\n{case.id} vs {ref_id}: max |loss diff| {loss_diff:.2e}, grad norm {norm_diff:.2e}; "
            f"losses {[round(x[0], 5) for x in got]}"
        )
        assert loss_diff < 1e-4 and norm_diff < 1e-4
        if routing:
            assert [x[2] for x in ref][0] == [x[2] for x in got][0], "same routing on the first step"
        _same_health(ref[-1][3], got[-1][3])
    if case.id in EXTRA_CHECKS:
        EXTRA_CHECKS[case.id](ep_cases)


# ----------------------------------------------------------------------------------------------
# The real train loop with EP=2: metrics, collapse flag, bitwise resume, consolidation, export
# ----------------------------------------------------------------------------------------------

TINY = [
    *tiny_model(hidden_size=64, num_kv_heads=2, max_seq_len=32, ffn_size=128, vocab_size=None),
    "moe.ffn_size=96",
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=3000",
    "data.num_streams=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=12",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_sequences=8",
    "checkpoint.every_steps=4",
    "cluster.num_workers=2",
    "cluster.use_ray=false",
    "parallel.expert=2",
    "moe.collapse_share=0.52",
    "moe.collapse_steps=3",
    "stability.plot_at_end=false",
]
MOE_CONFIG = ROOT / "configs" / "demo-moe.yaml"


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    """The real train loop on real gloo workers (a resume never runs in the processes that wrote its checkpoint):

    * a 12-step EP=2 run on 2 workers (``full``), the same run resumed from its step-8 checkpoint (``resumed``);
    * the run with replicated experts (EP=1, ``replicated``) and its step-4 checkpoint resumed on 1 worker
      (``elastic``);
    * expert layouts changed on resume: an EP=1 run on 1 worker (``layout_ref``), resumed at step 4 with 2 workers
      and EP=2 (``ep2``), whose step-8 checkpoint resumes with EP=1 on 2 workers under ZeRO-2 (``ep1``);
    * a 4-step EP=2 run in bf16 under ZeRO-1 (``bf16``)."""
    from pretrain.driver.prepare import prepare_new

    def prepare(*over: str):
        return prepare_new(load_config(MOE_CONFIG, [*TINY, *over]))

    base = [o for o in TINY if not o.startswith(("parallel.expert", "cluster.num_workers", "moe.collapse"))]
    with in_workdir(tmp_path_factory.mktemp("moe")) as work:
        full = prepare()
        tok = [f"data.tokenizer={Path(full.run_dir) / 'tokenizer'}"]
        replicated = prepare(*tok, "parallel.expert=1")
        layout_ref = prepare_new(load_config(MOE_CONFIG, base + tok + ["parallel.expert=1", "cluster.num_workers=1"]))
        run_jobs(1, [layout_ref], fresh=False)
        # each prepared once the checkpoint it resumes from exists (the driver checks checkpoint.resume_from)
        ep2 = prepare_new(
            load_config(
                MOE_CONFIG,
                base
                + tok
                + [
                    "parallel.expert=2",
                    "cluster.num_workers=2",
                    f"checkpoint.resume_from={Path(layout_ref.run_dir) / 'step_00000004'}",
                ],
            )
        )
        bf16 = prepare(*tok, "train.precision=bf16", "zero.stage=1", "train.max_steps=4")
        ranks = run_jobs(2, [full, replicated, ep2, bf16], fresh=False)
        resumed = prepare(*tok, f"checkpoint.resume_from={Path(full.run_dir) / 'step_00000008'}")
        ep1 = prepare_new(
            load_config(
                MOE_CONFIG,
                base
                + tok
                + [
                    "parallel.expert=1",
                    "cluster.num_workers=2",
                    "zero.stage=2",
                    f"checkpoint.resume_from={Path(ep2.run_dir) / 'step_00000008'}",
                ],
            )
        )
        elastic = prepare(
            *tok,
            "parallel.expert=1",
            "cluster.num_workers=1",
            f"checkpoint.resume_from={Path(replicated.run_dir) / 'step_00000004'}",
        )
        ranks_resumed = run_jobs(2, [resumed, ep1])
        run_jobs(1, [elastic])
        yield {
            "work": work,
            "uri": f"sqlite:///{work / 'mlflow.db'}",
            "full": full,
            "resumed": resumed,
            "final": ranks[0][0],
            "final_resumed": ranks_resumed[0][0],
            "ranks": [r[0] for r in ranks],
            "replicated": replicated,
            "elastic": elastic,
            "layout_ref": layout_ref,
            "ep2": ep2,
            "ep1": ep1,
            "bf16": bf16,
        }


def test_ep_training_logs_routing_metrics_and_flags_collapse(ep_runs):
    uri, final, run_id = ep_runs["uri"], ep_runs["final"], ep_runs["full"].run_id
    assert final["step"] == 12 and math.isfinite(final["final_train_loss"])
    for block in (0, 1):
        for name in (
            "expert0_tokens",
            "expert3_tokens",
            "max_share",
            "dropped_frac",
            "router_entropy",
            "aux_loss",
            "router_z_loss",
        ):
            assert sorted(metric_history(run_id, f"moe/block{block}/{name}", uri)) == list(range(1, 13)), name
    tokens = sum(final["moe"][f"moe/block0/expert{e}_tokens"] for e in range(4))
    assert tokens == 8 * 32 * 2, "every token of the global batch routed to 2 experts"
    events = final["stability"]["timeline"]
    assert [e["kind"] for e in events][:2] == ["router_collapse", "router_collapse"]
    assert events[0]["step"] == 3 and events[0]["action"] == "log"
    assert ep_runs["ranks"][0]["stability"] == ep_runs["ranks"][1]["stability"]


def test_ep_resume_is_bitwise(ep_runs):
    uri = ep_runs["uri"]
    full = metric_history(ep_runs["full"].run_id, "train/loss", uri)
    resumed = metric_history(ep_runs["resumed"].run_id, "train/loss", uri)
    assert sorted(resumed) == [9, 10, 11, 12]
    assert [resumed[s] for s in range(9, 13)] == [full[s] for s in range(9, 13)]
    assert ep_runs["final_resumed"]["final_train_loss"] == ep_runs["final"]["final_train_loss"]


def test_replicated_experts_resume_elastically(ep_runs):
    """With parallel.expert 1 the experts are ordinary data-parallel weights: 2 workers -> 1 through DeepSpeed's
    universal checkpoint continues the run (1 worker accumulates what 2 workers all-reduce)."""
    uri = ep_runs["uri"]
    ref = metric_history(ep_runs["replicated"].run_id, "train/loss", uri)
    got = metric_history(ep_runs["elastic"].run_id, "train/loss", uri)
    assert sorted(got) == list(range(5, 13))
    diff = max(abs(got[s] - ref[s]) for s in got)
    print(f"\nMoE (parallel.expert 1) elastic 2 -> 1 workers: max |loss diff| {diff:.2e}")
    assert diff < 1e-5


def test_expert_layout_changes_on_resume_keep_the_losses(ep_runs):
    """EP 1 -> 2 -> 1 on real gloo workers: an EP=1 run on 1 worker resumed at step 4 with 2 workers and EP=2 (its
    experts and their AdamW moments and step re-sharded), whose step-8 checkpoint resumes with EP=1 on 2 workers
    under ZeRO-2; every step's loss of both (5-12, 9-12) is within 1e-5 of the uninterrupted EP=1 run's. The
    conversion is cached and carries the optimizer state (moments and step), not a fresh one."""
    from pretrain.checkpoint.weights import load_optimizer_moments

    uri, ep2, ep1 = ep_runs["uri"], ep_runs["ep2"], ep_runs["ep1"]
    full = metric_history(ep_runs["layout_ref"].run_id, "train/loss", uri)
    legs = [metric_history(ep2.run_id, "train/loss", uri), metric_history(ep1.run_id, "train/loss", uri)]
    assert sorted(legs[0]) == list(range(5, 13)) and sorted(legs[1]) == list(range(9, 13))
    diff = max(abs(leg[s] - full[s]) for leg in legs for s in leg)
    print(f"\nEP 1 (1 worker) -> EP 2 (2 workers) -> EP 1 (2 workers, ZeRO-2): max |loss diff| {diff:.2e}")
    assert diff < 1e-5
    for run_dir, step in ((ep2.run_dir, 4), (ep1.run_dir, 8)):
        (converted,) = Path(run_dir).glob(f"full-step_{step:08d}-*")
        moments = load_optimizer_moments(converted)
        assert moments["step"] == step
        expert = "blocks.1.ffn.deepspeed_moe.experts.deepspeed_experts.3.down_proj.weight"
        assert moments["exp_avg_sq"][expert].abs().sum() > 0, "the experts' moments are carried over"


def test_ep_checkpoint_consolidates_every_expert_and_exports_to_mixtral(ep_runs, tmp_path):
    from pretrain.export.checkpoints import resolve_checkpoint
    from pretrain.export.hf import export_checkpoint, load_exported

    ckpt = Path(ep_runs["final"]["checkpoint"])
    loaded = resolve_checkpoint(str(ckpt))
    sd = loaded.state_dict()
    cfg = loaded.config
    reference = build_model(cfg.model, 0, MoEConfig(**asdict(cfg.moe))).state_dict()
    assert set(sd) == set(reference), "a full state dict: every expert of every layer, nothing else"
    experts = [k for k in sd if ".deepspeed_experts." in k]
    assert len(experts) == 2 * 4 * 3  # layers x experts x (gate, up, down)
    report = export_checkpoint(str(ckpt), tmp_path / "hf")
    print(f"\nEP=2 checkpoint -> {report.hf_class}: max |logits diff| {report.max_abs_diff:.2e}")
    assert report.hf_class == "MixtralForCausalLM" and report.standard
    assert report.max_abs_diff < 1e-4
    model = load_exported(tmp_path / "hf", "decoder")
    assert type(model).__name__ == "MixtralForCausalLM"


def test_a_bf16_ep_checkpoint_gives_its_fp32_masters(ep_runs):
    """What export, eval, grow and prune read of a bf16 EP=2 checkpoint: each parameter's fp32 master from the ZeRO
    optimizer files (experts under their global ids), which rounds to the module's bf16 weight; buffers as saved."""
    from pretrain.checkpoint import layout, weights
    from pretrain.checkpoint.reader import full_state_dict
    from pretrain.export.checkpoints import resolve_checkpoint

    loaded = resolve_checkpoint(str(Path(ep_runs["bf16"].run_dir) / "step_00000004"))
    got = full_state_dict(loaded.ckpt, loaded.config)
    tag = weights.ds_engine_dir(loaded.ckpt.path) / layout.DS_TAG
    module = weights.strip_module_prefix(weights.expert_parallel_state_dict(tag))
    masters, _ = weights.gathered_optimizer_state(loaded.ckpt.path, loaded.config.moe.num_experts)
    assert set(got) == set(module) and all(v.dtype == torch.float32 for v in got.values())
    assert any(v.dtype == torch.bfloat16 for v in module.values()), "the module state holds the training dtype"
    assert any(".deepspeed_experts.3." in name for name in masters), "every expert's master, under its global id"
    tied = loaded.config.model.tie_embeddings
    for name, value in got.items():
        if name in masters:
            assert torch.equal(value.bfloat16(), module[name].bfloat16()) and not value.requires_grad, name
        elif tied and name == "lm_head.weight":
            assert torch.equal(value, got["embed_tokens.weight"])
        else:
            assert torch.equal(value, module[name].float()), name
    assert any(not torch.equal(got[n], got[n].bfloat16().float()) for n in masters), "bits bf16 lacks: the masters"


def test_demo_moe_through_the_cli_and_ray_with_ep2_then_export_and_eval(tmp_path):
    """The real CLI and Ray Train (2 workers, EP=2) on configs/demo-moe.yaml (shrunk), then `export` (Mixtral,
    parity checked) and `eval` of the checkpoint, which agrees with the run's own final validation loss."""
    keep = (
        "model.num_layers",
        "model.hidden_size",
        "model.num_heads",
        "model.num_kv_heads",
        "model.max_seq_len",
        "data.",
        "train.global_batch_size",
        "train.micro_batch_size",
        "train.warmup_steps",
        "cluster.",
    )
    over = [o for o in E2E if o.startswith(keep)] + [
        "train.max_steps=6",
        "checkpoint.every_steps=6",
        "train.val_every=0",
        "parallel.expert=2",
        "moe.ffn_size=64",
    ]
    train = cli(tmp_path, "train", str(ROOT / "configs" / "demo-moe.yaml"), *over)
    assert "2 worker(s)" in train.stdout
    run_id = run_id_of(train.stdout)
    export = cli(tmp_path, "export", run_id, "--out", str(tmp_path / "hf"))
    assert "MixtralForCausalLM" in export.stdout and "parity: max |logits diff|" in export.stdout
    val = float(next(line for line in train.stdout.splitlines() if "final val loss" in line).split()[3])
    ev = cli(tmp_path, "eval", run_id, "--json")
    assert abs(json.loads(ev.stdout)["loss"] - val) < 1e-4
