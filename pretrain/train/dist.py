"""Process-group setup for the three ways the loop runs: under Ray Train (already initialized),
under torchrun (env vars), or as one plain process (a world of one, so DeepSpeed has a group)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain import ds_adapter
from pretrain.ports import free_port  # noqa: F401  (re-exported: dist.free_port)


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    under_ray: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _ray_context():
    try:
        import ray.train

        ctx = ray.train.get_context()
        ctx.get_world_size()  # raises outside a Ray Train worker
        return ctx
    except Exception:
        return None


def _ray_device() -> torch.device:
    import ray.train.torch

    return ray.train.torch.get_device()


def _ray_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def gpu_count(use_gpu: str, local_world: int) -> int:
    """The GPUs this node's workers get: 0 for a CPU run. ``cluster.use_gpu`` ``auto`` uses GPUs only when every
    local worker has its own (NCCL refuses two ranks on one GPU); ``yes`` with fewer GPUs than local workers is
    refused in one line, as is ``yes`` where torch cannot use a GPU (a CPU build, or a driver too old for its CUDA):
    never a CPU run in its place."""
    if use_gpu == "no":
        return 0
    if not torch.cuda.is_available():
        if use_gpu == "yes":
            why = (
                f"built for CUDA {torch.version.cuda}: no NVIDIA driver it can use (missing, or older than that CUDA "
                "needs)"
                if torch.version.cuda
                else "a CPU build"
            )
            raise ValueError(
                f"cluster.use_gpu: yes, but torch {torch.__version__} cannot use a GPU on this node ({why}); "
                "cluster.use_gpu=auto trains on the CPU where there is none"
            )
        return 0
    n = torch.cuda.device_count()
    if n >= local_world:
        return n
    if use_gpu == "yes":
        raise ValueError(
            f"cluster.use_gpu: yes, with {local_world} workers on this node but {n} GPU(s) visible to them "
            "(one GPU per worker): fewer workers per node, or cluster.use_gpu=no"
        )
    return 0


def gpu_device(local_rank: int, ray_device: torch.device | None = None) -> torch.device:
    """This worker's GPU: the one Ray assigned it (``ray.train.torch.get_device``: its index among the visible
    devices, whether each worker sees its own or all of the node's), else the local rank's among the visible
    devices (torchrun: all of them; one per task, as Slurm's ``--gpus-per-task=1`` gives: the only one)."""
    if ray_device is not None and ray_device.type == "cuda":
        return ray_device
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def match_deepspeed_accelerator(gpu: bool) -> None:
    """Make DeepSpeed's accelerator this run's device: ``DS_ACCELERATOR`` (read once, at DeepSpeed's first import)
    is set to ``cuda`` or ``cpu`` here, whatever a driver without a GPU passed on (a CPU head node, a laptop that
    submits); a CPU run on a GPU node would otherwise get DeepSpeed's CUDA accelerator, which moves the model to the
    GPU. Where DeepSpeed is already imported with the other accelerator, says so in one line."""
    want = "cuda" if gpu else "cpu"
    os.environ["DS_ACCELERATOR"] = want
    if (have := ds_adapter.loaded_accelerator()) not in (None, want):
        raise RuntimeError(f"DeepSpeed was imported with its {have} accelerator before this {want} run started")


def setup(use_gpu: str) -> DistContext:
    """Join (or create) the default process group and pick this worker's device (and DeepSpeed's accelerator)."""
    ray_ctx = _ray_context() if dist.is_initialized() else None
    if ray_ctx is not None:
        rank, world = ray_ctx.get_world_rank(), ray_ctx.get_world_size()
        local_rank, local_world = ray_ctx.get_local_rank(), ray_ctx.get_local_world_size()
        print(f"[train] rank {rank}/{world} on Ray node {ray_ctx.get_node_rank()} ({_ray_node_id()[:12]})", flush=True)
    elif dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    want_gpu = gpu_count(use_gpu, local_world) > 0
    if dist.is_initialized() and "nccl" not in str(dist.get_backend()):
        want_gpu = False  # a group another launcher made for CPU tensors (gloo): the run is on the CPU
    match_deepspeed_accelerator(want_gpu)
    ds_adapter.import_deepspeed()  # with that accelerator, before any thread of the run (the tracker's) starts
    if not dist.is_initialized():
        alone = "WORLD_SIZE" not in os.environ  # a plain single process
        if alone:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
                RANK="0",
                WORLD_SIZE="1",
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
            )
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        # Alone, the rendezvous is an in-memory store: no TCP port to listen on, so no race for a "free" port
        # that another process took in the meantime (EADDRINUSE).
        store = dist.HashStore() if alone else attempt_store(os.environ)
        dist.init_process_group("nccl" if want_gpu else "gloo", rank=rank, world_size=world, store=store)
    if want_gpu:
        device = gpu_device(local_rank, _ray_device() if ray_ctx is not None else None)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistContext(rank, world, local_rank, local_world, device, ray_ctx is not None)


def attempt_store(env) -> dist.Store | None:
    """The rendezvous store of a launch under torchrun (``env``: its variables), its keys under this attempt's own
    prefix; None (``env://`` as is) for another launcher. torch 2.13's agent keeps one store for every attempt of
    a launch (``torchrun --max-restarts``), so a restarted attempt's process groups read the addresses the dead
    attempt's ranks had published there and fail to connect (``Gloo connectFullMesh failed ... Connection
    refused``, also on the first ``new_group``)."""
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store, _, _ = next(dist.rendezvous("env://"))
    return dist.PrefixStore(f"pretrain/attempt_{attempt}", store)


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_min(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def broadcast_object(obj, src: int = 0):
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_object(obj, dst: int = 0) -> list:
    """Every rank's ``obj`` in rank order on ``dst`` (other ranks get an empty list)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    return out or []


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
