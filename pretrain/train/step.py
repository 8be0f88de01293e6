"""The step: one optimizer update over this rank's share of the global batch, and evaluation.

Everything that changes the math of an update (LR, micro-batching, clipping via DeepSpeed, loss
averaging across ranks) lives here; the loop around it only schedules and observes.
"""

from __future__ import annotations

import math
import zlib

import torch

from pretrain.train import dist
from pretrain.train.engine import global_grad_norm, set_lr


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the global torch RNG (dropout) for one step on one rank: resume needs no RNG replay."""
    return zlib.crc32(f"{seed}:{step}:{rank}".encode()) & 0x7FFFFFFF


def _micro_batches(batch: dict[str, torch.Tensor], micro: int, device: torch.device):
    n = batch["input_ids"].shape[0]
    for i in range(0, n, micro):
        yield {k: v[i:i + micro].to(device, non_blocking=True) for k, v in batch.items()}


def train_step(engine, batch: dict[str, torch.Tensor], micro: int, lr: float,
               device: torch.device) -> tuple[float, float]:
    """One optimizer step over this rank's share of the global batch -> (global mean loss, grad norm)."""
    set_lr(engine, lr)
    losses = []
    for mb in _micro_batches(batch, micro, device):
        out = engine(mb["input_ids"], labels=mb["labels"])
        engine.backward(out.loss)
        engine.step()  # DeepSpeed only updates at the gradient-accumulation boundary
        losses.append(out.loss.detach().float().item())
    (loss_sum,) = dist.all_reduce_sum([sum(losses) / len(losses)], device)
    return loss_sum / torch.distributed.get_world_size(), global_grad_norm(engine)


@torch.no_grad()
def evaluate(engine, batches: list[dict[str, torch.Tensor]], kind: str, device: torch.device) -> dict[str, float]:
    """Token-weighted validation loss (and MLM accuracy for encoders) over all ranks' shares."""
    engine.eval()
    loss_sum = count = correct = 0.0
    for mb in batches:
        mb = {k: v.to(device) for k, v in mb.items()}
        out = engine(mb["input_ids"], labels=mb["labels"])
        labels = mb["labels"][:, 1:] if kind == "decoder" else mb["labels"]
        n = float((labels != -100).sum())
        loss_sum += out.loss.float().item() * n
        count += n
        if kind == "encoder":
            pred = out.logits.argmax(-1)
            correct += float(((pred == labels) & (labels != -100)).sum())
    engine.train()
    loss_sum, count, correct = dist.all_reduce_sum([loss_sum, count, correct], device)
    loss = loss_sum / max(count, 1.0)
    metrics = {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}
    if kind == "encoder":
        metrics["val/mlm_acc"] = correct / max(count, 1.0)
    return metrics
