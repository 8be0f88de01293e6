"""The step (``pretrain/train/step.py``) on 2 real gloo ranks (the session's processes of ``tests/harness.py``):
what the padding micro-batches of uneven shares count, and the masked-LM objective as the token mean of the whole
step whatever the micro-batching. The step in training runs is in the integration tests (the trainer, growth,
stability, parallelism)."""

from __future__ import annotations

import pytest
import torch

from pretrain.train.step import StepHooks
from tests.harness import run_distributed, tiny_config

UNEVEN_MOE = (
    "model.dropout=0.0",
    "moe.num_experts=4",
    "moe.top_k=2",
    "moe.balance=bias",
    "moe.ffn_size=48",
    "train.global_batch_size=3",
    "data.num_streams=3",
    "cluster.num_workers=2",
)
"""An MoE on 2 workers with shares of 2 and 1 sequences: micro-batches of 1, rank 1 pads one."""


ENCODER = ("model.kind=encoder", "model.dropout=0.0", "train.precision=fp32", "zero.stage=0", "cluster.num_workers=2")
MLM_LAYOUTS = {
    "micro-4": ("train.global_batch_size=8", "data.num_streams=2", "train.micro_batch_size=4"),
    "micro-2": ("train.global_batch_size=8", "data.num_streams=2", "train.micro_batch_size=2"),
    "micro-1": ("train.global_batch_size=8", "data.num_streams=2", "train.micro_batch_size=1"),
    "uneven": ("train.global_batch_size=6", "data.num_streams=3", "train.micro_batch_size=2"),  # shares 4 and 2
}
"""Ways 2 workers split a global batch of masked sequences into micro-batches."""


class _Gradients(StepHooks):
    """Keeps the gradients after the step's last backward (reduced over the ranks: ZeRO-0)."""

    def after_backward(self, module) -> None:
        self.grads = {n: p.grad.detach().clone() for n, p in module.model.named_parameters() if p.grad is not None}


def _mlm_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences whose 15% masked positions differ in number from sequence to sequence."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (n, 16), generator=g)
    return ids, torch.where(torch.rand(n, 16, generator=g) < 0.15, ids, -100)


def _mlm_steps(rank: int) -> dict:
    """Per layout: the step's loss and gradients, and the token mean and its gradients of the whole global batch
    in one plain forward of the same model."""
    from pretrain.model import build_model
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step

    out = {}
    for name, layout in MLM_LAYOUTS.items():
        cfg = tiny_config(*ENCODER, *layout)
        module, hook = build_module(cfg), _Gradients()
        ids, labels = _mlm_batch(cfg.train.global_batch_size)
        start = sum(module.plan.shares[: module.plan.data_rank(rank)])
        part = slice(start, start + module.plan.share(rank))
        result = run_step(module, StepInput(1, {"input_ids": ids[part], "labels": labels[part]}, 0.0), [hook])
        model = build_model(cfg.model, cfg.train.seed, cfg.moe)
        loss = model(ids, labels=labels).loss
        loss.backward()
        reference = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out[name] = {"loss": (result.loss, float(loss)), "grads": (hook.grads, reference)}
        module.engine.destroy()
    return out


def _decoder_weights() -> list[float]:
    """The micro-batch weights of a decoder's full labels on uneven shares."""
    from pretrain.config import make_plan
    from pretrain.train.step import token_weights

    cfg = tiny_config("train.global_batch_size=6", "data.num_streams=3", "train.micro_batch_size=2")
    plan = make_plan(cfg, 2)
    ids = torch.zeros(plan.share(torch.distributed.get_rank()), 16, dtype=torch.long)
    return token_weights(ids, plan, True, torch.device("cpu")).tolist()


def _steps(rank: int, world: int) -> dict:
    from pretrain.model.moe import moe_layers
    from pretrain.train.module import build_module
    from pretrain.train.step import StepInput, run_step

    torch.set_num_threads(1)
    module = build_module(tiny_config(*UNEVEN_MOE))
    ids = torch.randint(0, 101, (3, 16), generator=torch.Generator().manual_seed(0))
    part = ids[:2] if rank == 0 else ids[2:]
    result = run_step(module, StepInput(1, {"input_ids": part, "labels": part}, 1e-3))
    return {
        "plan": (module.plan.shares, module.plan.grad_accum),
        "moe": result.moe,
        "biases": [b.clone() for _, layer in moe_layers(module.model) if (b := layer.selection_bias) is not None],
        "mlm": _mlm_steps(rank),
        "decoder_weights": _decoder_weights(),
    }


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    return run_distributed(_steps, 2, fresh=False)


def test_padding_micro_batches_count_in_no_routing_statistics(steps):
    """Rank 1 runs its one real micro-batch and one of padding: the step's routing statistics (which move the
    selection biases and make the ``moe/`` metrics and the collapse check) are those of the 3 real sequences."""
    r0 = steps[0]
    assert r0["plan"] == ((2, 1), 2)
    for block, row in r0["moe"].items():
        routed, forwards = row[:4], row[-1]
        assert forwards == 3 and routed.sum() == 3 * 16 * 2, (block, row)  # 3 sequences of 16 tokens, top-2
    assert all(torch.equal(a, b) for a, b in zip(r0["biases"], steps[1]["biases"]))


@pytest.mark.parametrize("layout", list(MLM_LAYOUTS))
def test_masked_lm_step_is_the_token_mean_of_the_whole_batch(steps, layout):
    """Masked sequences have different numbers of targets: on 2 workers, with 1, 2 or 4 micro-batches each or uneven
    shares, the step's loss and its gradients are the cross-entropy's token mean over all the step's targets (one
    forward of the whole batch), not a mean of the micro-batches' means."""
    for rank in steps:
        (loss, ref_loss), (grads, ref_grads) = rank["mlm"][layout]["loss"], rank["mlm"][layout]["grads"]
        assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0), (layout, loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{layout} {name}")


def test_full_labels_weigh_every_micro_batch_exactly_one(steps):
    """A decoder's micro-batches (full labels) all have as many targets: each weight is exactly 1, so its loss and
    gradients are those of the mean over micro-batches bit for bit."""
    assert [r["decoder_weights"] for r in steps] == [[1.0, 1.0], [1.0]]
