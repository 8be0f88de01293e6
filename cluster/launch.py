"""Run a prepared job through Ray Train (embedded local Ray, or an existing cluster), or in-process.

Ray code sees only the cluster settings; the training function receives the job as plain data.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pretrain.config import ClusterConfig
from pretrain.train.loop import Job, train_loop

ROOT = Path(__file__).resolve().parents[1]

# Environment variables forwarded to Ray workers (an explicit allowlist: never the whole environment).
_FORWARD_ENV = ("MLFLOW_DISABLE_TELEMETRY", "TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                "TOKENIZERS_PARALLELISM", "DS_ACCELERATOR", "DS_BUILD_OPS", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME")


def worker_env() -> dict[str, str]:
    env = {k: os.environ[k] for k in _FORWARD_ENV if k in os.environ}
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    pythonpath = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + pythonpath if pythonpath else "")
    return env


def ensure_ray(cluster: ClusterConfig) -> bool:
    """Connect to ``cluster.address`` / ``RAY_ADDRESS``, or start an embedded local Ray bound to
    127.0.0.1 without a dashboard. Returns True when this call started Ray (caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = cluster.address or os.environ.get("RAY_ADDRESS", "")
    runtime_env = {"env_vars": worker_env()}
    if address:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env=runtime_env, logging_level=logging.WARNING, configure_logging=True)
    return True


def run_with_ray(job: Job, cluster: ClusterConfig) -> dict[str, Any]:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    started = ensure_ray(cluster)
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        use_gpu = cluster.use_gpu == "yes" or (cluster.use_gpu == "auto" and gpus >= cluster.num_workers)
        trainer = TorchTrainer(
            train_loop,
            train_loop_config=asdict(job),
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ScalingConfig(num_workers=cluster.num_workers, use_gpu=use_gpu,
                                         resources_per_worker={"CPU": cluster.cpus_per_worker}),
            run_config=RunConfig(name=job.run_id, storage_path=str(Path(job.run_dir).parent / "_ray"),
                                 failure_config=FailureConfig(max_failures=cluster.max_failures),
                                 worker_runtime_env={"env_vars": worker_env()}),
        )
        result = trainer.fit()
        if result.error is not None:
            raise result.error
        return dict(result.metrics or {})
    finally:
        if started:
            ray.shutdown()


def run(job: Job, cluster: ClusterConfig) -> dict[str, Any]:
    """Run ``job`` with the configured backend and return the final metrics."""
    if cluster.use_ray:
        return run_with_ray(job, cluster)
    # No Ray: this process is the worker (a world of one, or one rank of a torchrun launch).
    sys.stdout.flush()
    return train_loop(asdict(job))
