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


def step_seed(seed: int, step: int, index: int) -> int:
    """Seed of the global torch RNG (dropout) for one step and one rank or micro-batch id: resume needs
    no RNG replay, and with micro-batch ids the masks do not depend on the worker count."""
    return zlib.crc32(f"{seed}:{step}:{index}".encode()) & 0x7FFFFFFF


def micro_batch_ids(rank: int, world_size: int, global_batch: int, micro: int, num_streams: int) -> list[int]:
    """Global ids of this rank's micro-batches in one step, independent of the worker count.

    Rank r holds, in order, the G/S sequences of each stream s = r, r+W, r+2W, ...; when the micro-batch
    divides G/S each micro-batch lies in one stream, and its id is (stream, offset) flattened — the same
    id whichever worker holds it. Otherwise ids fall back to rank order (still deterministic)."""
    per_rank = global_batch // world_size // micro
    per_stream_seqs = global_batch // num_streams
    if per_stream_seqs % micro:
        return [rank * per_rank + j for j in range(per_rank)]
    per_stream = per_stream_seqs // micro
    return [(rank + (j // per_stream) * world_size) * per_stream + j % per_stream for j in range(per_rank)]


def _micro_batches(batch: dict[str, torch.Tensor], micro: int, device: torch.device):
    n = batch["input_ids"].shape[0]
    for i in range(0, n, micro):
        yield {k: v[i:i + micro].to(device, non_blocking=True) for k, v in batch.items()}


def train_step(engine, batch: dict[str, torch.Tensor], micro: int, lr: float,
               device: torch.device, seeds: list[int] | None = None) -> tuple[float, float]:
    """One optimizer step over this rank's share of the global batch -> (global mean loss, grad norm).
    ``seeds``: per micro-batch seed of the global torch RNG (dropout), see ``micro_batch_ids``."""
    set_lr(engine, lr)
    losses = []
    for i, mb in enumerate(_micro_batches(batch, micro, device)):
        if seeds is not None:
            torch.manual_seed(seeds[i])
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
