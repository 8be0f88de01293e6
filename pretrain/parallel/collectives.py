"""Collectives on tensors that live elsewhere than the process group's backend wants them: the full-state gathers
of expert and tensor parallelism take host copies (checkpoints, export, growth), which NCCL refuses."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def collective_device(group=None) -> torch.device:
    """The device ``group``'s collectives run on: the current CUDA device when its backend is NCCL (which takes CUDA
    tensors only; also a ``cpu:gloo,cuda:nccl`` pair: the gather runs at NCCL's speed), else the host (gloo)."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(local: torch.Tensor, shapes: Sequence[Sequence[int]], group=None) -> list[torch.Tensor]:
    """Every rank's ``local`` (rank order; rank ``i``'s of shape ``shapes[i]``) over ``group``, gathered on
    :func:`collective_device` and returned on ``local``'s device. One tensor at a time: the device holds the
    gathered copies of one tensor only."""
    device = collective_device(group)
    send = local.to(device).contiguous()
    parts = [torch.empty(tuple(s), dtype=local.dtype, device=device) for s in shapes]
    dist.all_gather(parts, send, group=group)
    return [p.to(local.device) for p in parts]
