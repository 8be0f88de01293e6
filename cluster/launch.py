"""Run a prepared job through Ray Train (embedded local Ray, or an existing cluster), or in-process.

Ray code sees only the cluster settings; the training function receives the job as plain data.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar, cast

from cluster.placement import check_local_layout, check_train_address, local_cpus, wait_for_placement
from cluster.ray_process import end_ray_with_process, sigint_ignored, sigterm_blocked, sigterm_kept, stop_ray
from cluster.requires import require_ray_for
from cluster.submit import NETWORK_ENV
from pretrain import startup_gc, timeline
from pretrain.config import ClusterConfig
from pretrain.invocation import command
from pretrain.train.job import Job
from pretrain.train.stop_request import stops_deferred

# Environment variables forwarded to Ray workers (an explicit allowlist: never the whole environment).
_FORWARD_ENV = (
    "MLFLOW_DISABLE_TELEMETRY",
    "TORCH_EXTENSIONS_DIR",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "DS_ACCELERATOR",
    "MLFLOW_LOGGING_LEVEL",
    "DS_BUILD_OPS",
    "PYTORCH_CUDA_ALLOC_CONF",
    *NETWORK_ENV,
)


_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

T = TypeVar("T")


def train_worker(job: dict[str, Any]) -> dict[str, Any]:
    """The training function of every worker: :func:`pretrain.train.worker.train_loop`, imported where it runs (Ray
    pickles this function by reference), so that the driver never imports the training stack."""
    from pretrain.train.worker import train_loop

    return train_loop(job)


def ray_train_worker(job: dict[str, Any]) -> dict[str, Any]:
    """:func:`train_worker` in a Ray worker process: its start-up with the garbage collector paused (see
    :mod:`pretrain.startup_gc`; resumed after the first step, or when the function ends before one). A stability
    halt returns (rank 0 leaves it in the run directory for :func:`run_with_ray`, which raises it): Ray Train would
    retry a raised one from the last checkpoint (``cluster.max_failures``), replaying up to the halt, or past it
    where the replay is not bitwise."""
    from pretrain.train.stability.monitor import StabilityHaltError

    startup_gc.pause()
    try:
        return train_worker(job)
    except StabilityHaltError as e:  # every rank halts at the same step (all-reduced signals): a result, not a
        import ray.train  # failure that Ray Train would retry (cluster.max_failures) from the last checkpoint

        if ray.train.get_context().get_world_rank() == 0:
            from pretrain.checkpoint.layout import HALT
            from pretrain.checkpoint.store import write_json

            write_json(Path(job["run_dir"]) / HALT, {"line": str(e), "report": e.report})
        return {}
    finally:
        startup_gc.resume()


def worker_env(reuse_host_memory: bool = False) -> dict[str, str]:
    """The environment of Ray's worker processes; with ``reuse_host_memory`` (``train.reuse_host_memory``, for the
    training workers) glibc's malloc settings too (:func:`pretrain.train.host_memory.worker_malloc_env`)."""
    env = {k: os.environ[k] for k in _FORWARD_ENV if k in os.environ}
    if reuse_host_memory:
        from pretrain.train.host_memory import worker_malloc_env

        env.update(worker_malloc_env(dict(os.environ)))
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ray Train re-routes print() through its logger and also tees it: every progress line twice.
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::DeprecationWarning")
    # No PYTHONPATH: workers import the project installed in their environment (./launch.sh setup, the Dockerfile).
    # An embedded local Ray's workers inherit this process's environment, PYTHONPATH included (tests, launch.sh).
    return env


def ensure_ray(cluster: ClusterConfig) -> bool:
    """Connect to ``cluster.address`` / ``RAY_ADDRESS``, or start an embedded local Ray bound to
    127.0.0.1 without a dashboard. Returns True when this call started Ray (caller shuts it down)."""
    require_ray_for(cluster)
    address = _ray_address(cluster)
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    runtime_env = {"env_vars": worker_env()}
    if address:
        with sigterm_kept():
            ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    else:
        # No dashboard: its head and module processes are most of the CPU that Ray's own processes take from the
        # training worker on a small machine. Its State API serves only Train's placement-group cleaner, which
        # an embedded Ray does not run (:func:`_trainer_class`).
        # Nor Train's preemption watcher, an actor polling for the draining of cluster nodes every 5 s.
        runtime_env["env_vars"]["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
        # Train's controller polls the workers every 2 s by default, so a finished run would wait up to 2 s to be
        # noticed; a poll is one small actor call.
        runtime_env["env_vars"].setdefault(
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
        )
        # Nor the idle workers a raylet starts for its first driver (one per CPU): they have the default runtime
        # environment and Train's actors never do (Train gives each one its own), so they would be processes that
        # import Ray at start-up, while the controller and workers start, and are never used.
        # Nor at Ray's default niceness for its worker processes (15: a cluster node keeps its raylet responsive
        # under load): here they are the run itself (Train's controller and workers), and anything else this
        # terminal session runs at the default niceness would take nearly all the CPU from them (a nice-15 process
        # weighs 36 against 1,024; with the kernel's autogroups, the processes of one session compete among
        # themselves). Ray's own variable, RAY_worker_niceness, wins.
        system_config: dict[str, Any] = {"prestart_worker_first_driver": False}
        if "RAY_worker_niceness" not in os.environ:
            system_config["worker_niceness"] = 0
        # address="local": always a fresh private instance, never a cluster that happens to run here.
        # Its processes (and the workers they start) ignore SIGINT and block SIGTERM, which they inherit: Ctrl-C in a
        # terminal, `timeout`, `kill -- -PGID` or a scheduler reach the whole process group, and the run's stop
        # (pretrain.driver.signals) needs Ray alive to take its checkpoint.
        with sigint_ignored(), sigterm_kept(), sigterm_blocked():
            ray.init(
                address="local",
                num_cpus=local_cpus(),
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                runtime_env=runtime_env,
                logging_level=logging.WARNING,
                configure_logging=True,
                _system_config=system_config,
            )
    return True


def prepare_while_ray_starts(
    cluster: ClusterConfig, prepare: Callable[[], T], abandon: Callable[[T, BaseException], None] | None = None
) -> tuple[T, bool]:
    """``prepare()`` (creating the run: MLflow, tokenizer, config) in a thread while this thread starts Ray — Ray
    keeps the thread that starts it, since its servers are tied to it. For a job that trains in this process
    (``cluster.use_ray=false``, or one worker Ray would have nothing to do for:
    :meth:`~pretrain.config.ClusterConfig.trains_in_process`) or with a Ray already running, just ``prepare()``.
    Returns its result and whether Ray was started here (the caller shuts it down: :func:`stop_ray`). When either
    fails, Ray started here is shut down and the failure raised (the preparation's, when it failed first: a bad
    config or corpus is the user's error to see); when this thread fails or is interrupted (a stop) while the
    preparation goes on, the preparation is waited for and what it made is handed to ``abandon(result, error)``
    (the caller ends the run it created), as is the run of a preparation whose ``import torch`` fails. Timeline:
    ``ray`` while Ray starts, ``run_preparation`` for any wait for the rest of the preparation (its own phases
    overlap Ray's start)."""
    if cluster.trains_in_process():
        return prepare(), False
    check_local_layout(cluster)  # before anything starts
    _ray_address(cluster)
    pool = ThreadPoolExecutor(1, thread_name_prefix="run-preparation")
    prepared = pool.submit(timeline.quietly, lambda: _prepare_then_import(prepare, abandon))
    timeline.enter("ray")
    started = False
    try:
        started = ensure_ray(cluster)
        timeline.enter("run_preparation")
        result = prepared.result()
        pool.shutdown(wait=True)
    except BaseException as e:
        failed_first = prepared.done() and prepared.exception() is not None
        with stops_deferred("ending the run being created (its creation first; SIGKILL ends at once)"):
            # a stop ends the command: Ray's agents, still starting, would outlive a graceful shutdown by a minute
            (end_ray_with_process if isinstance(e, KeyboardInterrupt) else stop_ray)(started)
            if not prepared.done():
                print("[pretrain] waiting for the run's creation to end, to end the run", flush=True)
            pool.shutdown(wait=True)
            if failed_first:
                raise cast(BaseException, prepared.exception()) from None  # not None: checked above
            if abandon is not None and prepared.exception() is None:
                abandon(prepared.result(), e)
        raise
    timeline.enter("ray")
    return result, started


def _prepare_then_import(prepare: Callable[[], T], abandon: Callable[[T, BaseException], None] | None) -> T:
    """``prepare()``, then ``import torch`` (Ray Train's TorchTrainer imports it next: here it overlaps Ray's
    start); when the import fails, the prepared run is handed to ``abandon`` before the failure is raised."""
    result = prepare()
    try:
        import torch  # noqa: F401
    except BaseException as e:
        if abandon is not None:
            abandon(result, e)
        raise
    return result


def _ray_address(cluster: ClusterConfig) -> str:
    """The cluster address, or "" for an embedded local Ray, which is then kept on 127.0.0.1.

    On Linux Ray swaps 127.0.0.1 for the host's routable IP and binds its gRPC servers on all
    interfaces unless "cluster mode" is off; it reads that switch when ``ray`` is first imported,
    so this must run before any Ray import."""
    check_train_address(cluster)
    address = cluster.address or os.environ.get("RAY_ADDRESS", "")
    # Every worker's lines as they come: Ray's dedup folds lines that differ only in numbers ("rank 1/2 ...")
    # into a "[repeated Nx]" line seconds later. Read with the constants, at Ray's first import.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not address:
        if "ray._private.ray_constants" in sys.modules and os.environ.get(_LOCAL_ONLY_ENV) != "0":
            print("[pretrain] warning: Ray was imported early; it may bind beyond 127.0.0.1", file=sys.stderr)
        os.environ[_LOCAL_ONLY_ENV] = "0"
    return address


def run_with_ray(job: Job, cluster: ClusterConfig) -> dict[str, Any]:
    check_local_layout(cluster)  # before Ray starts (preflight checked it too; derived runs come straight here)
    _ray_address(cluster)
    import ray
    from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig

    TorchTrainer = _trainer_class(embedded=not _ray_address(cluster))
    started = ensure_ray(cluster)
    try:
        gpus = ray.cluster_resources().get("GPU", 0)
        use_gpu = cluster.use_gpu == "yes" or (cluster.use_gpu == "auto" and gpus >= cluster.num_workers)
        wait_for_placement(cluster, use_gpu, say=lambda line: print(line, flush=True))
        trainer = TorchTrainer(
            ray_train_worker,
            train_loop_config=asdict(job),
            torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
            scaling_config=ScalingConfig(
                num_workers=cluster.num_workers,
                use_gpu=use_gpu,
                resources_per_worker={"CPU": cluster.cpus_per_worker},
                placement_strategy=cluster.placement_strategy,
            ),
            # worker_runtime_env, logging_config: Ray Train V2's RunConfig (ray 2.60), absent from the stubs mypy sees
            run_config=RunConfig(
                name=job.run_id,
                storage_path=str(Path(job.run_dir).parent / "_ray"),  # type: ignore[call-arg]
                failure_config=FailureConfig(max_failures=cluster.max_failures),
                worker_runtime_env={"env_vars": worker_env(_reuses_host_memory(job))},
                logging_config=LoggingConfig(log_level="WARNING"),
            ),
        )
        from pretrain.checkpoint.layout import HALT

        halt = Path(job.run_dir) / HALT
        halt.unlink(missing_ok=True)  # (an earlier attempt's, its driver gone before it read it)
        result = trainer.fit()
        if result.error is not None:
            raise result.error
        if halt.is_file():
            from pretrain.train.stability.monitor import StabilityHaltError

            said = json.loads(halt.read_text())
            halt.unlink()
            raise StabilityHaltError(said["line"], said.get("report"))
        return read_summary(job)
    finally:
        stop_ray(started)


def _trainer_class(embedded: bool):
    """Ray Train's ``TorchTrainer``; on an embedded local Ray, :class:`cluster.embedded.EmbeddedTorchTrainer`
    (without the actors that serve nothing there). Either without Train's own SIGINT handler, which would abort the
    workers where the driver's (:mod:`pretrain.driver.signals`) has them stop with a checkpoint, and with a failure
    policy that restarts no worker group after a user error (:mod:`cluster.failures`)."""
    from ray.train.torch import TorchTrainer

    base = TorchTrainer
    if embedded:
        from cluster.embedded import EmbeddedTorchTrainer

        base = EmbeddedTorchTrainer

    class Trainer(base):  # type: ignore[valid-type,misc]
        def _register_sigint_handler(self, controller) -> None:
            pass

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            from cluster.failures import UserErrorsEndTheRun

            controller_init_kwargs["failure_policy"] = UserErrorsEndTheRun(controller_init_kwargs["failure_policy"])
            return super()._initialize_and_run_controller(**controller_init_kwargs)

    return Trainer


def _reuses_host_memory(job: Job) -> bool:
    return bool(job.config.get("train", {}).get("reuse_host_memory", True))


def read_summary(job: Job) -> dict[str, Any]:
    """The final metrics rank 0 wrote into the run directory (shared storage)."""
    from pretrain.checkpoint.layout import SUMMARY  # here: the driver imports torch in the run's preparation

    path = Path(job.run_dir) / SUMMARY
    return json.loads(path.read_text()) if path.is_file() else {}


def alone_note(cluster: ClusterConfig, env: dict[str, str] | None = None) -> str | None:
    """The line of a job that asks for several workers but trains in this one process (no Ray, and no launcher
    started other ranks: ``WORLD_SIZE`` unset or 1 in ``env``, the environment by default), or None."""
    n = cluster.num_workers
    world = (os.environ if env is None else env).get("WORLD_SIZE", "1")
    if n <= 1 or not world.isdigit() or int(world) > 1:
        return None
    return (
        f"[pretrain] cluster.num_workers={n} without Ray (cluster.use_ray=false) and without a launcher: this process "
        f"trains alone, as 1 worker with the same global batch (gradient accumulation); for {n} processes: "
        f"torchrun --nproc_per_node {n} -m pretrain ..."
    )


def restarts_note(cluster: ClusterConfig) -> str | None:
    """The line of a job that asks for restarts (``max_failures``) but trains without Ray, which is what restarts a
    failed worker group; or None."""
    if cluster.use_ray or cluster.max_failures <= 0:
        return None
    return (
        f"[pretrain] note: cluster.max_failures={cluster.max_failures} has no effect with cluster.use_ray=false: "
        f"nothing restarts the workers if one fails ({command()} resume RUN_ID continues from the last checkpoint)"
    )


def run(job: Job, cluster: ClusterConfig) -> dict[str, Any]:
    """Run ``job`` with the configured backend and return the final metrics."""
    if not cluster.trains_in_process():
        timeline.enter("ray")  # until the worker's training function starts (worker start-up and imports included)
        startup_gc.resume()  # this process now waits for the workers for the whole run
        return run_with_ray(replace(job, startup=timeline.marks()), cluster)
    job = replace(job, startup=timeline.marks())
    # No Ray: this process is the worker (a world of one, or one rank of a torchrun launch).
    for note in (alone_note(cluster), restarts_note(cluster)):
        if note:
            print(note, flush=True)
    sys.stdout.flush()
    return train_worker(asdict(job))
