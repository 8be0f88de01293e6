"""The sections of how a run executes rather than what it trains: ZeRO, checkpoints, the cluster, tracking,
fault injection and stability control (a docstring on every field; cross-field rules in ``RunConfig.validate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pretrain.config.errors import ConfigError, quote

GPU_MEMORY_GIB: dict[str, float] = {
    "A10G-24GB": 24,
    "L4-24GB": 24,
    "L40S-48GB": 48,
    "A100-40GB": 40,
    "A100-80GB": 80,
    "H100-80GB": 80,
    "H100-94GB": 94,
    "H200-141GB": 141,
    "B200-180GB": 180,
}
"""The GPUs ``cluster.gpu_type`` names and their nominal memory in GiB, the figure in the name (the CUDA context,
NCCL and the allocator take some of it: the plan's verdict keeps a margin)."""

YAML_KEY = "yaml_key"
"""Field metadata: the key users write when it differs from the field name (a Python keyword: ``async``)."""


@dataclass(kw_only=True)
class ZeroConfig:
    stage: int = 1
    """DeepSpeed ZeRO stage: 0 (plain data parallel), 1, 2 or 3."""
    offload_optimizer: bool = False
    """Offload optimizer state to CPU memory (stages 1-3): the fp32 masters and AdamW moments live in host memory
    and torch's fused AdamW steps them there (on GPU runs, GPU memory for host memory and a step that waits on the
    host). Refused with ``stage: 0``, which has no optimizer state of ZeRO's to offload."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient reduction bucket."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward (GPU)."""
    param_persistence_threshold: int = 100_000
    """ZeRO-3: parameters with at most this many elements are not partitioned (kept whole on every rank);
    DeepSpeed's default. 0 partitions every parameter (tests use it to exercise the gathers at demo sizes)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = "checkpoints"
    """Root of checkpoints; each run writes ``DIR/RUN_ID/step_NNNNNNNN``. Must be shared by all nodes."""
    every_steps: int = 100
    """Commit a checkpoint every N steps (and always at the end); 0 only at the end."""
    keep_last: int = 0
    """Delete older committed checkpoints beyond the newest N; 0 keeps all. Under ``stability.policy: rollback`` the
    rollback target and the checkpoints not yet good (``stability.good_after_steps``) are kept too, so more than N
    may exist for a while: each until a newer checkpoint becomes the target or a spike rules it out."""
    resume_from: str = ""
    """A committed checkpoint directory to resume from (set by ``resume``)."""
    async_: bool = field(default=True, metadata={YAML_KEY: "async"})
    """``checkpoint.async``: the loop stalls only while each rank copies its state to host memory; writing,
    hashing and fsync run in a background thread while training continues, and the checkpoint is committed
    (manifest, rename, MLflow, pruning) at the first step boundary after every rank has finished. At most one
    save is in flight (the next waits); a background failure ends the run at the next step boundary; the last
    checkpoint is committed before the run ends. Default on: the same files, checksums and atomic commit as a
    synchronous save at a fraction of its stall, for one extra host copy of this rank's state. False writes and
    commits inside the save (the loop waits for the disk)."""
    keep_host_buffers: bool = True
    """Asynchronous saves: keep the host memory of one snapshot from a save to the next and copy the next
    snapshot into it (a fresh allocation faults in every page, which makes the copy several times slower; on a GPU
    the memory is pinned, which is slow to allocate). False frees it once each save is written."""
    overlap_copy: bool = True
    """Asynchronous saves: copy the state to host memory in the background while the next step's forward and
    backward run (they change none of it); the optimizer update, and anything else that changes the state
    (loading, growth), waits for the copy first. The loop then stalls only for what the copy takes beyond the
    forward and backward (counted in ``ckpt/stall_s`` as ``copy_wait_s``). False copies inside the save."""
    on_stop: Literal["save", "exit"] = "save"
    """What a stop does — SIGTERM (a scheduler's preemption), SIGINT (Ctrl-C), ``./launch.sh stop JOB``:
    ``save``: every rank finishes its current step, the run commits a checkpoint at that step (and the save in
    flight), the MLflow run ends ``KILLED`` with the stop recorded, and the command exits 143 (SIGTERM) or 130
    (SIGINT) naming the checkpoint and the resume command. ``exit``: the run ends at once, with no new checkpoint (the
    latest committed one stays). A second signal always ends the run at once."""
    stop_timeout_s: float = 300.0
    """Seconds a ``save`` stop may take (the current step and the checkpoint) before the run ends at once, as on a
    second signal. Keep it under the scheduler's own grace period (Kubernetes ``terminationGracePeriodSeconds``,
    Slurm ``--signal=TERM@SECONDS``); ``submit`` sets Ray Jobs' (``RAY_JOB_STOP_WAIT_TIME_S``) from it."""
    direct_io: bool = True
    """Write the large engine files (weights, optimizer partitions, experts) with direct I/O (``O_DIRECT``)
    from a few reused buffers, hashed as they are written, instead of through the page cache; a filesystem that
    refuses it gets buffered writes. Files and checksums are the same either way. A buffered write's speed
    depends on how fast the kernel finds fresh page-cache pages, which can vary widely from one save to the next;
    a direct write's does not (see ``pretrain/checkpoint/hashed_write.py``). False: buffered writes."""


@dataclass(kw_only=True)
class ClusterConfig:
    num_workers: int = 1
    """Training workers (processes). Each gets ``cpus_per_worker`` CPUs and one GPU when ``use_gpu``."""
    use_gpu: Literal["auto", "yes", "no"] = "auto"
    """``auto`` uses GPUs when the cluster has one for every worker (a worker's node: one per local worker), else
    the CPU; ``yes`` refuses fewer GPUs than workers, and a torch that cannot use the node's GPU (never the CPU in
    their place); ``no`` runs on the CPU (DeepSpeed's CPU accelerator, also on a GPU node)."""
    cpus_per_worker: float = 1.0
    """CPUs reserved per worker in Ray: a whole number, or a fraction below 1 (e.g. 0.5), which lets more workers
    than CPUs share a machine: Ray places 3 workers of 0.5 on 2 CPUs (each still runs ``train.num_threads``
    threads)."""
    address: str = ""
    """Ray address of an existing cluster; empty uses ``RAY_ADDRESS`` or starts an embedded local Ray."""
    max_failures: int = 0
    """Times Ray restarts a failed worker group (from the latest committed checkpoint). A user error in a worker (a
    config it refuses, a malformed record under ``data.bad_records=fail``, a checkpoint that does not verify, a
    growth that fails its check, a save to a full disk or a read-only place) ends the run at once: a restart would
    fail the same way (``cluster/failures.py``)."""
    use_ray: bool = True
    """Run through Ray Train; false runs the training function in this process (or under torchrun)."""
    ray_for_one_worker: bool = False
    """Run a job of one worker through an embedded local Ray too. False (default): a job Ray would have nothing to
    do for — one worker, no cluster (``address``, ``RAY_ADDRESS``), no restarts (``max_failures`` 0) — trains in
    this process, as ``use_ray=false`` does. Starting Ray, its Train controller and a worker process delay such a
    job's first step (seconds on a small machine), and Ray's processes take CPU time from every step."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement of the workers: PACK fills nodes first; SPREAD / STRICT_SPREAD put them on
    different nodes."""
    start_timeout: float = 600.0
    """Seconds a job on a Ray cluster (``address`` / ``RAY_ADDRESS``) waits for the cluster to place all its
    workers, saying every few seconds what is missing, before it ends with one line (exit 2); 0 waits without
    limit (an autoscaler slow to add nodes). An embedded local Ray refuses a layout it cannot place at once."""
    gpus_per_node: int = 8
    """GPUs (one worker each) per node in the plan ``train --dry-run`` prints: ``num_workers`` are laid out on
    ceil(num_workers / gpus_per_node) nodes. Only the plan reads it; Ray places the workers wherever they fit."""
    gpu_type: str = ""
    """The GPU the plan checks its memory estimate against (``train --dry-run``: "fits" or "does not fit" and what to
    change; docs/memory-plan.md), one of :data:`GPU_MEMORY_GIB` (e.g. ``H100-80GB``); empty: no verdict. Naming a
    GPU also plans GPU workers (bf16 for ``train.precision: auto``) when ``use_gpu`` is ``auto``."""

    def validate(self) -> None:
        """The plan's fields: ``gpus_per_node`` positive, ``gpu_type`` empty or a known GPU."""
        if self.gpus_per_node <= 0:
            raise ConfigError(f"cluster.gpus_per_node: must be > 0, got {self.gpus_per_node}")
        if self.gpu_type and self.gpu_type not in GPU_MEMORY_GIB:
            raise ConfigError(
                f"cluster.gpu_type: {quote(self.gpu_type)} is not a known GPU (known: {', '.join(GPU_MEMORY_GIB)}; "
                f"empty for no memory verdict)"
            )

    def trains_in_process(self, ray_address: str | None = None) -> bool:
        """Whether the job trains in this process instead of through Ray Train: ``use_ray`` false, or one worker
        that Ray would have nothing to do for (see ``ray_for_one_worker``). ``ray_address``: the environment's
        ``RAY_ADDRESS`` (None reads it)."""
        if not self.use_ray:
            return True
        if ray_address is None:
            import os

            ray_address = os.environ.get("RAY_ADDRESS", "")
        return (
            self.num_workers == 1
            and not (self.address or ray_address)
            and self.max_failures == 0
            and not self.ray_for_one_worker
        )


@dataclass(kw_only=True)
class ParallelConfig:
    """The parallel layout: how many workers share each sequence, each layer, the experts of each MoE layer. The
    data-parallel degree is what remains: ``cluster.num_workers / (sequence x tensor)``. The layout, its rank
    mapping and its rules live in ``pretrain/parallel/`` (docs/parallelism.md)."""

    sequence: int = 1
    """Workers that share each sequence (DeepSpeed Ulysses): each holds ``max_seq_len / N`` of its tokens, and
    attention exchanges sequence shards for head shards (all-to-all) so it still sees the whole sequence.
    ``cluster.num_workers`` must be a multiple of ``sequence x tensor``; the quotient is the data-parallel degree.
    Needs the attention and key-value head counts and ``model.max_seq_len`` divisible by it."""
    tensor: int = 1
    """Workers that share each layer (DeepSpeed AutoTP): the attention and FFN projections are split column- and
    row-wise across them; embeddings, norms and the LM head stay whole. Needs the head counts and the FFN size
    divisible by it, ZeRO stage 0, 1 or 2, and ``model.attention_dropout`` 0; not with MoE."""
    expert: int = 1
    """Expert-parallel degree (MoE models): each worker holds ``moe.num_experts / expert`` experts of every MoE
    layer and tokens travel by all-to-all; must divide ``moe.num_experts`` and the worker count, with ZeRO stage
    1 or 2. 1 = experts replicated like dense weights. Ignored for a dense model."""


@dataclass(kw_only=True)
class TrackingConfig:
    experiment: str = "pretrain"
    """MLflow experiment name."""
    run_name: str = ""
    """MLflow run name; empty uses the config name."""
    enabled: bool = True
    """Log to MLflow (the URI comes from ``MLFLOW_TRACKING_URI``, default ``sqlite:///mlflow.db``)."""
    system_metrics: bool = False
    """Also log MLflow's own system metrics (CPU, memory, disk, network, GPU: ``system/*``, sampled every 10 s)
    from rank 0 while the run trains."""


@dataclass(kw_only=True)
class FaultsConfig:
    """Fault injection for tests of fault tolerance (all off by default)."""

    kill_worker_at_step: int = -1
    """The worker of rank 1 (rank 0 in a world of one) kills itself with SIGKILL once, when it is about
    to run this step (1-based). -1 disables."""
    stop_after_step: int = -1
    """End training cleanly after this step (validation and a committed checkpoint), as if the job had
    been stopped there; ``resume`` continues it. -1 disables."""
    nan_grad_at_step: int = -1
    """The worker of rank 1 (rank 0 in a world of one) turns its gradient of this step (1-based) into NaN
    (the loss stays finite), once per run. Exercises ``stability`` non-finite detection. -1 disables."""
    loss_spike_at_step: int = -1
    """The update of this step (1-based) uses 1000x the scheduled LR on every worker, once per run, so the
    following steps' loss spikes. Exercises ``stability`` spike detection and rollback. -1 disables."""
    nan_weights_at_step: int = -1
    """After this step (1-based) one weight of the model is NaN on every worker, once per run, so the next
    checkpoint finds non-finite weights (ZeRO 0-2, whose ranks hold whole weights). Exercises the rollback a save
    decides. -1 disables."""
    slow_checkpoint_at_step: int = -1
    """Every rank's background write of the checkpoint of this step (``checkpoint.async``) first sleeps
    ``slow_checkpoint_s`` seconds, once per run (across restarts), so a test can act while a save is in flight.
    -1 disables."""
    slow_checkpoint_s: float = 60.0
    """The sleep of ``slow_checkpoint_at_step``."""
    slow_step_s: float = 0.0
    """Every step first sleeps this long on every rank (the numbers do not change), so a test can act mid-run
    (send a signal) whatever the machine's speed. 0 disables."""
    slow_run_creation_s: float = 0.0
    """The driver sleeps this long while it creates a run, once its MLflow run exists (before its tokenizer), so a
    test can stop the command while the run is being created. 0 disables."""


@dataclass(kw_only=True)
class StabilityConfig:
    """Training-stability monitoring and control (see ``pretrain/train/stability/monitor.py``).

    Every step, the all-reduced loss and pre-clipping gradient norm are checked before the optimizer
    step: non-finite values, spikes against rolling median/MAD statistics, and a rising loss trend.
    ``policy`` decides what an event does; every event is recorded in MLflow and the progress output."""

    policy: Literal["log", "skip", "rollback", "halt"] = "skip"
    """What a detected event does. ``log``: record only. ``skip``: drop the update of a non-finite or
    spiking step (weights and optimizer state untouched, the batch is consumed); a divergence is only
    logged. ``rollback``: skip non-finite steps; on a spike or divergence (or too many consecutive skips)
    restore the last good checkpoint, continue from the current data position (skipping the data window
    since that checkpoint) with a cooled-down LR (needs ``checkpoint.every_steps`` > 0). ``halt``: stop at the
    first event with a report.
    Default ``skip``, as OLMo-core's skip-step optimizer: cheap, and a false positive costs one batch."""
    health_every: int = 10
    """Log health metrics (per-block gradient/parameter norms, update/parameter ratios, activation RMS and
    max, attention logit max, output logit mean square, non-finite counts) every N steps; 0 disables."""
    window: int = 128
    """Rolling window (steps) of the loss and gradient-norm statistics. Every finite value enters it, warm-up
    steps and flagged spikes included: the median and MAD shrug off the outliers they flag."""
    spike_threshold: float = 6.0
    """A loss or gradient norm more than this many robust sigmas above the window median is a spike; the
    sigma is 1.4826 * MAD, and at least 1 % of the median (a nearly constant series is not flagged for noise)."""
    warmup_steps: int = 100
    """No spike or divergence detection during the first N steps (losses fall fast and LR warms up);
    non-finite values are always detected."""
    detect_grad_spikes: bool = True
    """Also treat gradient-norm spikes as events (not only loss spikes)."""
    divergence_window: int = 256
    """Slow divergence: the least-squares trend of the last N healthy losses; 0 disables."""
    divergence_threshold: float = 0.05
    """Divergence when the fitted loss trend rises by more than this fraction of the window's mean loss
    over the window."""
    max_consecutive_skips: int = 10
    """The N-th consecutive step that would be skipped escalates instead (N - 1 are skipped): ``rollback`` rolls
    back, ``skip`` halts."""
    max_rollbacks: int = 3
    """Halt when a run needs more rollbacks than this."""
    good_after_steps: int = 20
    """A committed checkpoint becomes a rollback target ("good") after this many healthy steps past it
    without a spike or divergence."""
    lr_cooldown_factor: float = 0.5
    """After a rollback the LR is multiplied by this factor for ``lr_cooldown_steps`` steps (1 disables)."""
    lr_cooldown_steps: int = 50
    """Length of the LR cool-down after a rollback, in steps (0 disables)."""
    plot_at_end: bool = True
    """Rank 0 draws loss, gradient norm and events into a PNG in the run directory (and MLflow) at the end."""


MAX_SECONDS = 1e9
"""The longest wait a config may give (about 31 years; Python's timers overflow near 9.2e9 s)."""


def check_waits(checkpoint: CheckpointConfig, faults: FaultsConfig) -> None:
    """The config's waits within :data:`MAX_SECONDS` (a longer one would overflow its timer, mid-run)."""
    for key, seconds in (
        ("checkpoint.stop_timeout_s", checkpoint.stop_timeout_s),
        ("faults.slow_checkpoint_s", faults.slow_checkpoint_s),
        ("faults.slow_step_s", faults.slow_step_s),
        ("faults.slow_run_creation_s", faults.slow_run_creation_s),
    ):
        if seconds > MAX_SECONDS:
            raise ConfigError(f"{key}: {seconds:g} s is more than {MAX_SECONDS:g} s, the longest wait accepted")
