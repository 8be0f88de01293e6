"""Never a silent wait for Ray: a worker layout that cannot be placed is refused or reported.

Ray Train waits for its workers' resources without a word (it retries the worker group's start every minute,
visible only in the driver's log). Before it is asked to: on an embedded local Ray, :func:`check_local_layout`
refuses a layout this machine cannot hold, before Ray starts; on a cluster, :func:`wait_for_placement` reserves
the workers' resources with a placement group like Ray Train's own and, while the cluster cannot place it (busy,
too small, or an autoscaler adding nodes), says what is missing, until ``cluster.start_timeout``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

from pretrain.config import ClusterConfig, ConfigError

SAY_EVERY_S = 15.0  # a waiting line at the start, then this often


class PlacementError(ConfigError):
    """The cluster did not place the workers within ``cluster.start_timeout`` (a user error: exit 2)."""


def local_cpus() -> int:
    """The CPUs an embedded local Ray offers (``ensure_ray`` starts it with this many)."""
    return os.cpu_count() or 1


def local_gpus() -> int:
    """NVIDIA GPUs of this machine (what an embedded local Ray would find), without initializing CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(list(Path("/dev").glob("nvidia[0-9]*")))


def fits(total: float, share: float, workers: int) -> bool:
    return workers * share <= total + 1e-9


def check_train_address(cluster: ClusterConfig) -> None:
    """Refuse (one line) a Jobs API address (``http(s)://HEAD:8265``, what ``submit`` and Ray's job CLI take) as
    the cluster a run trains on: ``ray.init`` connects to a cluster's GCS (``HEAD:6379``) and rejects it."""
    given = [("cluster.address", cluster.address), ("RAY_ADDRESS", os.environ.get("RAY_ADDRESS", ""))]
    for key, address in given:
        if address.strip().lower().startswith(("http://", "https://")):
            raise ConfigError(
                f"{key}={address}: a Jobs API (dashboard) address, which a run cannot train on: submit the run "
                f"there (./launch.sh submit CONFIG --address {address}), give the cluster's GCS address (HEAD:6379), "
                f"or unset it to train on this machine"
            )


def check_local_layout(cluster: ClusterConfig) -> None:
    """Refuse (one line naming what to set) the workers an embedded local Ray on this machine cannot place all
    at once, and a Jobs API address to train on through Ray (:func:`check_train_address`). A no-op for a job that
    trains in this process (:meth:`ClusterConfig.trains_in_process`), whatever ``RAY_ADDRESS`` says, and otherwise
    with a cluster address or ``RAY_ADDRESS``."""
    if cluster.trains_in_process():
        return
    check_train_address(cluster)
    if cluster.address or os.environ.get("RAY_ADDRESS"):
        return
    check_layout(cluster, local_cpus(), local_gpus(), "this machine has", "an embedded local Ray")


def check_layout(cluster: ClusterConfig, cpus: float, gpus: int, has: str, what: str) -> None:
    """Refuse the workers that ``cpus`` CPUs and ``gpus`` GPUs (what ``has``: "this machine has", "the local head
    offers"; ``what`` the Ray it is) cannot hold all at once: Ray would wait for them forever."""
    n, share = cluster.num_workers, cluster.cpus_per_worker
    if not fits(cpus, share, n):
        fewer = int(cpus // share + 1e-9)
        fraction = math.floor(cpus / n * 100) / 100
        raise ConfigError(
            f"cluster.num_workers: {n} workers x cluster.cpus_per_worker={share:g} need {n * share:g} CPUs, but {has} "
            f"{cpus:g} ({what}; Ray would wait forever): set cluster.num_workers={fewer} or fewer, or "
            f"cluster.cpus_per_worker={fraction:g} (the workers then share the CPUs)"
        )
    if cluster.use_gpu == "yes" and gpus < n:
        raise ConfigError(
            f"cluster.use_gpu: yes, with {n} workers of one GPU each, but {has} {gpus} GPU(s): set "
            f"cluster.num_workers={max(gpus, 1)} or fewer, or cluster.use_gpu=auto"
        )


def worker_bundle(cluster: ClusterConfig, use_gpu: bool) -> dict[str, float]:
    """The resources of one worker, as Ray Train's ScalingConfig asks for them."""
    return {"CPU": float(cluster.cpus_per_worker), **({"GPU": 1.0} if use_gpu else {})}


def describe_shortfall(bundle: dict[str, float], workers: int, free: dict[str, float]) -> tuple[int, str]:
    """(workers the cluster's free resources could hold, what is missing for all of them), from its totals."""
    placeable = min([workers] + [int(free.get(k, 0.0) // v + 1e-9) for k, v in bundle.items() if v > 0])
    missing = {k: v * workers - free.get(k, 0.0) for k, v in bundle.items() if v * workers > free.get(k, 0.0) + 1e-9}
    if not missing:  # enough in total, but not on the nodes the strategy needs
        return placeable, f"no resource in total: no node set fits {workers} x {_fmt(bundle)}"
    return placeable, ", ".join(f"{k} {v:g}" for k, v in missing.items())


def wait_for_placement(
    cluster: ClusterConfig,
    use_gpu: bool,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
) -> float:
    """Block until the cluster can place all workers at once (a placement group of their bundles with the
    configured strategy, removed again for Ray Train's own), saying what is missing while it cannot; raise
    :class:`PlacementError` after ``cluster.start_timeout`` seconds (0: never). Returns the seconds waited."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    n, bundle, limit = cluster.num_workers, worker_bundle(cluster, use_gpu), cluster.start_timeout
    start = clock()
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=cluster.placement_strategy)
    try:
        said = None
        while not ray.wait([pg.ready()], timeout=min(2.0, max(limit - (clock() - start), 0.1)) if limit else 2.0)[0]:
            left = limit - (clock() - start)
            placeable, missing = describe_shortfall(bundle, n, ray.available_resources())
            if limit and left <= 0:
                raise PlacementError(
                    f"cluster.start_timeout: the cluster placed no group of {n} worker(s) of {_fmt(bundle)} "
                    f"({cluster.placement_strategy}) in {cluster.start_timeout:g} s ({placeable}/{n} fit its free "
                    f"resources; missing {missing}): free resources, or set fewer cluster.num_workers, a smaller "
                    f"cluster.cpus_per_worker or a longer cluster.start_timeout"
                )
            if said is None or clock() - said >= SAY_EVERY_S:
                say(
                    f"[pretrain] waiting for the cluster to place {n} worker(s) of {_fmt(bundle)} "
                    f"({cluster.placement_strategy}): {placeable}/{n} fit its free resources, missing {missing}; "
                    + (
                        f"giving up in {left:.0f} s (cluster.start_timeout)"
                        if limit
                        else "waiting on (cluster.start_timeout=0)"
                    )
                )
                said = clock()
        waited = clock() - start
        if said is not None:
            say(f"[pretrain] the cluster placed {n}/{n} worker(s) after {waited:.0f} s")
        return waited
    finally:
        remove_placement_group(pg)


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"
