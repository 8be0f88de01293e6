"""Sequence parallelism (DeepSpeed Ulysses, ``parallel.sequence``) and tensor parallelism (DeepSpeed AutoTP,
``parallel.tensor``) with real gloo processes: the same per-step losses as 1 process fed the same global
batches (decoder with GQA and encoder; 2 and 4 workers under ZeRO-1, 2 and 3; with layer dropout; with an early
exit), bitwise resume on the same layout and resume on another one; and the user's path through the CLI and Ray (2
workers equal 1; a growth schedule, layer dropout and early exits under sequence parallelism, stopped, resumed with
tensor parallelism as torchrun ranks, exported with the parity check)."""

from __future__ import annotations

import json
import re

import pytest

from tests.harness import Case, case_ids, cli, learnable_batches, run_cases, run_distributed, run_id_of, tiny_model

STEPS, GLOBAL, MICRO = 20, 8, 4
COMMON = (
    "model.dropout=0.0",
    f"train.global_batch_size={GLOBAL}",
    f"train.micro_batch_size={MICRO}",
    "data.num_streams=2",
    "train.lr=1e-2",
    "train.warmup_steps=2",
    f"train.max_steps={STEPS}",
    "train.precision=fp32",
    "train.seed=3",
    "zero.stage=1",
)
DEC = ("model.num_kv_heads=2",)  # GQA: 2 query heads per key-value head
ENC = ("model.kind=encoder", "model.position=learned")
SP, TP = "parallel.sequence=2", "parallel.tensor=2"
DROP = ("layer_drop.rate=0.5", "layer_drop.mode=sample")
EXIT = ("layer_drop.early_exit.layers=all",)  # the early exit after block 1, through the shared head
# MoE without a capacity limit or auxiliary terms routes each token on its own: a worker's slice routes as the whole
MOE = ("moe.num_experts=4", "moe.top_k=2", "moe.aux_loss_weight=0", "moe.router_z_loss_weight=0")
CASES = [
    Case("dec-1w", DEC, 1),
    Case("enc-1w", ENC, 1),
    Case("dec-drop-1w", (*DEC, *DROP), 1),
    Case("dec-mha-1w", (*DEC, "model.num_kv_heads=4"), 1),
    Case("dec-qk-1w", (*DEC, "model.qk_norm=true"), 1),
    Case("moe-1w", (*DEC, *MOE), 1),
    Case("dec-exit-1w", (*DEC, *EXIT), 1),
    Case("dec-sp2", (*DEC, SP), 2),
    Case("dec-tp2", (*DEC, TP), 2),
    Case("dec-qk-tp2", (*DEC, TP, "model.qk_norm=true"), 2),  # per-head norms: gradients summed over the group
    Case("dec-qk-sp2", (*DEC, SP, "model.qk_norm=true"), 2),
    Case("enc-sp2", (*ENC, SP), 2),
    Case("enc-tp2", (*ENC, TP), 2),
    Case("dec-sp2-drop", (*DEC, SP, *DROP), 2),
    Case("dec-sp2-z3", (*DEC, SP, "zero.stage=3"), 2),
    Case("dec-tp2-drop", (*DEC, TP, *DROP), 2),
    Case("dec-sp2-dp2-z1", (*DEC, SP), 4),
    Case("dec-sp2-dp2-z2", (*DEC, SP, "zero.stage=2"), 4),
    Case("dec-tp2-dp2-z1", (*DEC, TP), 4),
    Case("dec-tp2-dp2-z2", (*DEC, TP, "zero.stage=2"), 4),
    Case("dec-sp2-tp2", (*DEC, SP, TP, "model.num_kv_heads=4"), 4),  # 4 key-value heads: one per worker
    Case("moe-sp2-ep2", (*DEC, *MOE, SP, "parallel.expert=2"), 2),
    Case("moe-sp2-dp2-ep2", (*DEC, *MOE, SP, "parallel.expert=2"), 4),
    Case("dec-sp2-exit", (*DEC, SP, *EXIT), 2),
    Case("dec-sp2-z3-exit", (*DEC, SP, "zero.stage=3", *EXIT), 2),
    Case("dec-tp2-exit", (*DEC, TP, *EXIT), 2),
    Case("dec-dp2-z2-exit", (*DEC, "zero.stage=2", *EXIT), 2),  # data parallel, ZeRO-2
]
# case -> the 1-process case it must equal
REFERENCE = {
    **{c.id: "dec-1w" for c in CASES if c.id.startswith("dec-")},
    **{c.id: "enc-1w" for c in CASES if c.id.startswith("enc-")},
    **{c.id: "dec-drop-1w" for c in CASES if c.id.endswith("-drop")},
    **{c.id: "dec-qk-1w" for c in CASES if c.id.startswith("dec-qk-")},
    "dec-sp2-tp2": "dec-mha-1w",
    **{c.id: "moe-1w" for c in CASES if c.id.startswith("moe-")},
    **{c.id: "dec-exit-1w" for c in CASES if c.id.endswith("-exit")},
}


def _train(rank: int, world: int, overrides: list[str]) -> list[float]:
    from pretrain.config import load_config
    from pretrain.train.callbacks.early_exit import EarlyExitCallback
    from pretrain.train.callbacks.layer_drop import LayerDropCallback
    from pretrain.train.module import build_module
    from tests.harness import TINY_MODEL, train_steps

    cfg = load_config(None, [*TINY_MODEL, *COMMON, *overrides, f"cluster.num_workers={world}"])
    module = build_module(cfg)
    hooks = []
    if cfg.layer_drop.enabled:
        drop = LayerDropCallback(cfg, rank, module.plan.micro_batch_ids(rank))
        hooks.append(drop)
    if cfg.layer_drop.early_exit.enabled:
        hooks.append(EarlyExitCallback(cfg))

    def before(step: int) -> None:
        for h in hooks:
            h.on_step_start(None, step + 1)

    results = train_steps(module, learnable_batches(STEPS, GLOBAL), rank, world, hooks=hooks, seeds=True, before=before)
    return [r.loss for r in results] + [r.grad_norm for r in results]


@pytest.fixture(scope="module")
def runs():
    return run_cases(_train, CASES)


@pytest.mark.parametrize("case", CASES[7:], ids=case_ids(CASES[7:]))
def test_model_parallel_equals_one_process(runs, case):
    """Every rank reports the same losses, and they equal 1 process's on the same global batches within 1e-5
    relative over 20 steps; so do the gradient norms (replicated weights counted once)."""
    ranks = runs[case.id]
    assert all(r == ranks[0] for r in ranks), "every rank must report the same (all-reduced) loss"
    ref = REFERENCE[case.id]
    losses, norms = ranks[0][:STEPS], ranks[0][STEPS:]
    ref_losses, ref_norms = runs[ref][0][:STEPS], runs[ref][0][STEPS:]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    print(f"\n{case.id} vs {ref}: max relative loss difference {rel:.2e}")
    assert losses[-1] < losses[0] - 0.5, "training must reduce the loss"
    assert rel < 1e-5
    assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-4


def _resume(rank: int, world: int, tmp: str) -> dict:
    """Train 3 steps with tensor parallelism, then 3 more (A). From the checkpoint contents (full weights and moments,
    as a resume reads them): the same layout gives A bitwise; sequence parallelism gives A within 1e-5. Sequence-
    parallel engine state saved and loaded gives the uninterrupted losses bitwise."""
    from pathlib import Path

    from pretrain.config import load_config
    from pretrain.train.module import build_module
    from pretrain.train.optimizer_state import load_moments
    from tests.harness import TINY_MODEL, train_steps

    batches = learnable_batches(6, GLOBAL)

    def module_of(*layout, weights=None):
        cfg = load_config(None, [*TINY_MODEL, *COMMON, *DEC, *layout, f"cluster.num_workers={world}"])
        return build_module(cfg, weights=weights)

    def losses(module, part):
        return [r.loss for r in train_steps(module, part, rank, world)]

    out = {}
    tp = module_of(TP)
    losses(tp, batches[:3])
    saved = tp.checkpoint_state()
    out["tp"] = losses(tp, batches[3:])
    for name, layout in (("tp-resumed", (TP,)), ("sp-resumed", (SP,))):
        m = module_of(*layout, weights=saved.weights)
        load_moments(m, saved.moments)
        out[name] = losses(m, batches[3:])
    sp = module_of(SP)
    losses(sp, batches[:3])
    sp.save(Path(tmp) / "sp")
    out["sp"] = losses(sp, batches[3:])
    again = module_of(SP)
    again.load(Path(tmp) / "sp")
    out["sp-resumed-engine"] = losses(again, batches[3:])
    return out


def test_resume_on_the_same_and_another_layout(tmp_path):
    out = run_distributed(_resume, 2, str(tmp_path), fresh=False)[0]
    assert out["tp-resumed"] == out["tp"], "resume on the same tensor-parallel layout must be bitwise"
    assert out["sp-resumed-engine"] == out["sp"], "resume on the same sequence-parallel layout must be bitwise"
    assert max(abs(a - b) / b for a, b in zip(out["sp-resumed"], out["tp"])) < 1e-5


GROWN = [
    *tiny_model(num_kv_heads=2, max_seq_len=32, dropout=0.0, vocab_size=None),
    "data.tokenizer_vocab_size=512",
    "data.tokenizer_train_docs=3000",
    "data.num_streams=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.max_steps=6",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.val_every=0",
    "train.val_sequences=8",
    "checkpoint.every_steps=2",
    "cluster.num_workers=2",
    "stability.plot_at_end=false",
    "layer_drop.rate=0.3",
    "growth.schedule=[{at_step: 2, depth: 2x, depth_op: identity, noise: 0}, {at_step: 5, width: 2x, noise: 0}]",
]


def test_through_ray_two_workers_equal_one(tmp_path):
    """`./launch.sh train` as users run it: 2 workers through Ray with sequence parallelism and with tensor
    parallelism log the per-step losses of 1 worker on the same global batches within 1e-5 relative over 20 steps
    (the encoder preset: learned positions, biases, post-norm and the MLM head; the ranks of a sequence- or
    tensor-parallel group read the same batches from the streams). The decoder (RoPE, GQA) through the CLI:
    sequence parallelism through Ray resumed with tensor parallelism as torchrun ranks, the next test; against 1
    process on gloo ranks: ``dec-sp2``, ``dec-tp2`` and the rest of ``CASES``."""
    from mlflow import MlflowClient

    from tests.harness import ROOT

    preset = "demo-encoder"
    base = [o for o in GROWN if not o.startswith(("growth.", "layer_drop.", "train.max_steps", "checkpoint."))]
    base += ["train.max_steps=20", "checkpoint.every_steps=20"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    losses = {}
    for name, layout in {"one": ("cluster.num_workers=1",), "sp2": (SP,), "tp2": (TP,)}.items():
        out = cli(tmp_path, "train", str(ROOT / "configs" / f"{preset}.yaml"), *base, *layout, timeout=600).stdout
        history = sorted((x.step, x.value) for x in client.get_metric_history(run_id_of(out), "train/loss"))
        assert [step for step, _ in history] == list(range(1, 21))
        losses[name] = [v for _, v in history]
    for name in sorted(losses.keys() - {"one"}):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses["one"]))
        print(f"{preset} {name} through Ray vs 1 worker: max relative loss difference {rel:.2e}")
        assert rel < 1e-5


def test_sequence_parallel_run_resumes_tensor_parallel_and_exports(tmp_path):
    """Through the CLI and Ray (2 workers): a decoder with a growth schedule and layer dropout under sequence
    parallelism (depth growth at step 2) stops after step 4 (a checkpoint); `resume` (as 2 torchrun ranks, no Ray:
    tensor parallelism through Ray is the previous test's) continues it with tensor parallelism (the engine state
    converted to full weights and moments; width growth at step 5 rebuilds the tensor-parallel module); the grown model
    exports to Hugging Face with the parity check. The growth points and the length are given as a budget
    (``at_tokens``, ``at_fraction`` of ``train.max_flops``), derived once and the same on resume. With early exits
    (``all``, rotational): the blocks the depth growth adds join the exit schedule, across the resume on another layout,
    and the final validation scores every exit of the grown model."""
    from mlflow import MlflowClient

    from pretrain.config import load_config
    from pretrain.driver.budget import run_flops
    from tests.harness import CONFIG

    grown = [
        *GROWN,
        "model.vocab_size=512",
        "layer_drop.early_exit.layers=all",
        "layer_drop.early_exit.curriculum=rotational",
    ]
    budget, at_5 = run_flops(load_config(CONFIG, grown)), run_flops(load_config(CONFIG, grown), 5)
    grown += [
        "growth.schedule=[{at_tokens: 512, depth: 2x, depth_op: identity, noise: 0}, "
        f"{{at_fraction: {(at_5 - 1) / (budget - 1)!r}, width: 2x, noise: 0}}]",
        f"train.max_flops={budget - 1!r}",
    ]
    out = cli(tmp_path, "train", CONFIG, *grown, SP, "faults.stop_after_step=4", timeout=600).stdout
    run = run_id_of(out)
    assert "2 data x" not in out and "(1 data x 2 sequence x 1 tensor parallel)" in out
    assert "growth.schedule[0]: at_tokens 512 -> at_step 2 (256 tokens/step)" in out
    assert re.search(r"growth.schedule\[1\]: at_fraction \S+ of train.max_flops \S+ -> at_step 5", out)
    assert re.search(r"train.max_flops \S+ -> train.max_steps 6 ", out)
    out = cli(tmp_path, "resume", run, "parallel.sequence=1", TP, "cluster.use_ray=false", ranks=2, timeout=600).stdout
    assert "tensor parallel resume" in out and "(1 data x 1 sequence x 2 tensor parallel)" in out
    assert "-> train.max_steps" not in out and "-> at_step" not in out, "a resume derives the same steps"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    steps = sorted(x.step for x in client.get_metric_history(run, "train/loss"))
    assert steps == [1, 2, 3, 4, 5, 6]
    trained = {x.step: x.value for x in client.get_metric_history(run, "early_exit/trained_exits")}
    assert trained == {1: 1, 2: 0, 3: 2, 4: 1, 5: 2, 6: 1}, "exit 1 of 2 blocks, then exits 1, 2, 3 of 4, by rotation"
    exits = client.get_run(run).data.metrics
    assert all(f"val/exit_{d}/{k}" in exits for d in (1, 2, 3) for k in ("loss", "acceptance"))
    report = cli(tmp_path, "export", run, "--out", str(tmp_path / "hf"), timeout=600).stdout
    assert "LlamaForCausalLM" in report and re.search(r"parity: max \|logits diff\|", report)
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported["num_hidden_layers"], exported["hidden_size"]) == (4, 64)
