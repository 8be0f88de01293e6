"""The ``train`` section of the config tree: steps, batch, optimizer and LR schedule, precision, recomputation,
validation and profiling (cross-field rules in :meth:`pretrain.config.tree.RunConfig.validate`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pretrain.config.errors import ConfigError


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = 300
    """Number of optimizer steps."""
    seed: int = 1234
    """Seed of model init, data order, dropout and MLM masks."""
    global_batch_size: int = 16
    """Sequences per optimizer step across all workers; it stays what you set whatever the worker count
    (must be divisible by ``data.num_streams``)."""
    micro_batch_size: int = 16
    """Most sequences per forward/backward on one worker (a memory cap): the run plan picks the largest
    micro-batch within it that splits each worker's share, and gradient accumulation fills the rest."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The decay's floor as a fraction of the peak: the LR of the last step of ``wsd``; ``cosine`` and ``linear``
    reach it at step ``max_steps``, one after the last (whose LR is one decay step above it)."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    decay: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Shape of the decay from peak to ``min_lr_ratio * lr`` after warm-up. ``wsd`` (warmup-stable-decay; Hu et al.
    2024, MiniCPM, arXiv:2404.06395): the peak until the last ``decay_steps`` (or ``decay_fraction``) steps, then
    ``decay_shape`` down to the floor; a stable-phase checkpoint can be annealed later (``./launch.sh anneal``), so
    the run length is decided late."""
    decay_steps: int = 0
    """``decay: wsd``: steps of the decay phase at the end of the run; 0 uses ``decay_fraction``."""
    decay_fraction: float = 0.2
    """``decay: wsd`` with ``decay_steps: 0``: the decay phase as a fraction of ``max_steps``, in (0, 1]. A
    fraction longer than the steps after warm-up has no stable phase: the warm-up runs to its end and the LR then
    falls to where the decay has reached (keep it at most ``1 - warmup_steps / max_steps``)."""
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"
    """``decay: wsd``: shape of the decay phase (``1-sqrt``: lr = peak - (peak - floor) * sqrt(progress))."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to biases, norms and embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """``auto``: bf16 on GPUs that support it, fp32 on CPU."""
    log_every: int = 10
    """Progress line and MLflow metrics every N steps."""
    val_every: int = 100
    """Validation every N steps (and at the end); 0 only at the end."""
    val_every_flops: float = 0.0
    """Also validate each time the run's training FLOPs (``train/flops``: model FLOPs per token times tokens, each
    growth stage counted at its own size) pass a multiple of this; 0: off. Runs of different sizes, grown or not,
    are then validated at the same FLOPs (``val_every: 0`` for these points only). Needs validation, as
    ``stop_at_val_loss`` does."""
    max_flops: float = 0.0
    """A training budget in FLOPs (as ``train/flops`` counts them); > 0 derives ``max_steps`` (printed when the run
    is created): the steps whose FLOPs reach the budget, the model before each growth counted at its size. A run
    grown by ``growth.schedule`` then ends at the FLOPs of one trained from scratch, and a cosine or linear schedule
    decays fully at the budget."""
    val_sequences: int = 64
    """Validation sequences (global, split across workers; the same set whatever the worker count)."""
    num_threads: int = 0
    """torch intra-op threads per worker; 0 divides the CPUs of the node among local workers."""
    reuse_host_memory: bool = True
    """Keep freed host memory in each worker for the next step (glibc malloc thresholds, once per process) instead
    of returning it to the kernel and faulting it in again every CPU step (``pretrain/train/host_memory.py``).
    The worker then holds its peak host memory, which every step reaches anyway; no effect on GPU tensors."""
    activation_checkpointing: Literal["none", "full", "selective"] | bool = "none"
    """Recompute activations in the backward pass to save memory: ``full`` recomputes whole blocks (only their
    inputs are kept), ``selective`` keeps the matmul and attention outputs and recomputes the cheap elementwise and
    norm work (``pretrain/model/recompute.py``), ``none`` keeps everything. Booleans: true = full, false = none."""
    compile: Literal["auto", "yes", "no"] = "auto"
    """Compile each Transformer block with ``torch.compile`` (regional: embeddings, loss, optimizer stay eager).
    ``auto``: on for CUDA, off on CPU, where it costs a one-time compile of seconds per block shape and gains
    little at demo sizes (``./launch.sh bench`` measures both; results in ``benchmarks/results/``), and off under
    ZeRO-3 (DeepSpeed's parameter gathers are module hooks inside the blocks) and under sequence or tensor
    parallelism (``parallel.*``); ``yes`` is refused in both. Layer
    dropout does not recompile; the health probe's forwards (``stability.health_every``) run eagerly, so its hooks
    recompile nothing."""
    stop_at_val_loss: float = 0.0
    """End the run (with its final checkpoint) at the first validation whose loss is at or below this; 0 never.
    Needs validation (``data.val_holdout`` > 0 or ``data.val_sources``, and ``val_sequences`` > 0)."""
    profile_at: int = 0
    """Profile training steps from this one (1-based) with the torch profiler: a Chrome trace and an operator table
    per rank in ``RUN_DIR/profile/`` (rank 0's also in MLflow); 0 never."""
    profile_steps: int = 3
    """How many steps ``profile_at`` profiles."""

    def __post_init__(self) -> None:
        if isinstance(self.activation_checkpointing, bool):  # a boolean: true = full, false = none
            self.activation_checkpointing = "full" if self.activation_checkpointing else "none"

    def wsd_decay_steps(self) -> int:
        """Length of the decay phase of ``decay: wsd`` (``decay_steps``, else ``decay_fraction`` of the run)."""
        return self.decay_steps or max(1, round(self.decay_fraction * self.max_steps))

    def check_decay(self, steps_known: bool) -> None:
        """The decay's fields; with ``steps_known`` (``max_steps`` is the run's), a WSD ``decay_steps`` longer than
        the steps after warm-up is refused. (A ``decay_fraction`` is of the whole run: where it reaches into the
        warm-up, the decay starts where the warm-up ends, from the LR it has reached there.)"""
        if self.decay_steps < 0:
            raise ConfigError(f"train.decay_steps: must be >= 0, got {self.decay_steps}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError(f"train.decay_fraction: must be in (0, 1], got {self.decay_fraction}")
        after = self.max_steps - self.warmup_steps
        if self.decay == "wsd" and steps_known and self.decay_steps and self.decay_steps > after:  # 0: a fraction
            raise ConfigError(
                f"train.decay_steps: {self.decay_steps} is more than the {after} steps after warm-up "
                "(train.max_steps - train.warmup_steps)"
            )
