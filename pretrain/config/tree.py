"""The config tree: one dataclass per section, a docstring on every field, cross-field rules in
:meth:`RunConfig.validate` (and ``MoEConfig.validate``). Strict loading lives in ``loading.py``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal


class ConfigError(ValueError):
    """A user error in a config: the message names the full key path. It is one line: line breaks (say, of a
    value the user typed) become spaces."""

    def __init__(self, message: object = "") -> None:
        super().__init__(" ".join(str(message).splitlines()))


BYTE_LEVEL_VOCAB = 260
"""The smallest trained tokenizer: a byte-level BPE has the 256 bytes and 4 special tokens."""
MAX_GLOBAL_BATCH = 1 << 20
"""The most sequences per step we accept (the largest real runs take a few thousand)."""
_COUNT = re.compile(r"\s*(\d+(\.\d+)?x|\+\d+|\d+)\s*")  # growth targets: 2x, 1.5x, +4, 12


# ----------------------------------------------------------------------------------------------
# The tree
# ----------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModelConfig:
    kind: Literal["decoder", "encoder"] = "decoder"
    """``decoder``: causal LM (next-token loss). ``encoder``: masked LM (BERT-style 80/10/10)."""
    vocab_size: int = 0
    """Vocabulary size; 0 takes it from the tokenizer (rounded up to ``vocab_multiple``)."""
    vocab_multiple: int = 64
    """When ``vocab_size`` is taken from the tokenizer, round it up to a multiple of this."""
    max_seq_len: int = 128
    """Sequence length of packed training sequences (and of learned position tables)."""
    num_layers: int = 4
    """Number of Transformer blocks."""
    hidden_size: int = 256
    """Model width (residual stream size)."""
    num_heads: int = 4
    """Attention heads; ``hidden_size`` must be divisible by it."""
    num_kv_heads: int = 0
    """Key/value heads for grouped-query attention (decoders); 0 means ``num_heads`` (plain MHA)."""
    ffn_size: int = 0
    """FFN inner size; 0 means 4*hidden for GELU and the 8/3*hidden (rounded to 64) for SwiGLU."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """FFN activation: GELU MLP or gated SwiGLU."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Normalization layer type."""
    norm_placement: Literal["pre", "post", "deepnorm", "sandwich"] = "pre"
    """``pre``: x + f(norm(x)). ``post``: norm(x + f(x)) (BERT). ``deepnorm``: norm(alpha*x + f(x))
    with DeepNet's alpha/beta init scaling (Wang et al. 2022). ``sandwich``: x + norm(f(norm(x)))
    (sub-LN style extra output norm, as in CogView/NormFormer)."""
    norm_eps: float = 1e-5
    """Epsilon of every norm layer."""
    position: Literal["learned", "rotary"] = "rotary"
    """Absolute learned position embeddings or rotary (RoPE) applied to queries and keys."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    tie_embeddings: bool = True
    """Share the input embedding matrix with the output projection."""
    bias: bool = False
    """Use biases in linear layers (and norms for LayerNorm)."""
    dropout: float = 0.0
    """Dropout on embeddings, attention output and FFN output (residual dropout)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization of weights."""
    embedding_norm: bool = False
    """Apply a norm right after the embeddings (BERT has one)."""
    final_norm: bool = True
    """Apply a final norm before the LM head (automatically off for post-LN, which ends normed)."""
    mlm_head_transform: bool = False
    """Encoders: BERT-style head transform (dense + activation + norm) before the output projection."""
    z_loss: float = 0.0
    """Stabilizer: weight of the PaLM z-loss ``mean(logsumexp(logits)^2)`` added to the training objective
    (1e-4 is typical; 0 disables). It keeps the softmax normalizer near 1 so output logits cannot drift
    up; reported losses stay the plain cross-entropy."""
    qk_norm: bool = False
    """Stabilizer: normalize queries and keys per head (the configured norm over ``head_dim``, before RoPE)
    so attention logits cannot grow without bound (OLMo 2, Qwen3, Gemma 3)."""
    embedding_scale: float = 1.0
    """Stabilizer: multiply the token embeddings by this factor; 0 means ``sqrt(hidden_size)`` (T5/Gemma
    style, so a small-std embedding enters the residual stream at unit scale)."""
    init_from_hf: str = ""
    """A Hugging Face model directory of a supported family to start from (architecture and weights are
    taken from it; the architecture fields above are then ignored). Its tokenizer is used too."""


@dataclass(kw_only=True)
class SourceConfig:
    path: str
    """A file, a glob, a directory, ``demo`` (the built-in corpus), or anything ``datasets.load_dataset``
    accepts (a hub name or URL, when online)."""
    format: Literal["auto", "text", "json", "parquet", "hub"] = "auto"
    """File format; ``auto`` decides from the extension (``.txt``, ``.jsonl``/``.json``, ``.parquet``)."""
    text_field: str = "text"
    """Field that holds the document text for json/parquet/hub records."""
    weight: float = 1.0
    """Relative sampling weight in a mixture of several sources."""
    name: str = ""
    """Display name (defaults to the path); used in bad-record reports and metrics."""
    split: str = "train"
    """Split to stream for hub datasets."""


@dataclass(kw_only=True)
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig(path="demo")])
    """Training sources, mixed by weight."""
    val_sources: list[SourceConfig] = field(default_factory=list)
    """Validation sources; empty means hold out ``val_holdout`` of the training documents."""
    val_holdout: float = 0.01
    """Fraction of training documents (chosen by a hash of their text) held out for validation when
    ``val_sources`` is empty. 0 disables validation."""
    tokenizer: str = ""
    """Directory of a Hugging Face fast tokenizer; empty trains a byte-level BPE on the sources."""
    tokenizer_vocab_size: int = 8192
    """Vocabulary size of a tokenizer trained from the corpus."""
    tokenizer_train_docs: int = 50_000
    """How many documents from the training stream the tokenizer is trained on."""
    num_streams: int = 8
    """Virtual data streams: documents are dealt to streams by global document index, each stream is
    packed on its own, and worker r reads the streams s with s % num_workers == r. The global sample
    order therefore does not depend on the worker count; it must be divisible by it."""
    bad_records: Literal["skip", "fail"] = "skip"
    """Malformed records (bad JSON, missing text field, undecodable bytes, empty text): ``skip`` counts
    and reports them (file and line); ``fail`` stops with a one-line error."""
    mlm_probability: float = 0.15
    """Encoders: fraction of tokens selected for prediction (of which 80% [MASK], 10% random, 10% kept)."""
    repeat: bool = True
    """Restart the sources when exhausted (multi-epoch) instead of ending training."""
    cache_dir: str = ".cache/pretrain"
    """Where the built-in demo corpus is materialized (relative paths resolve against the launch dir)."""
    piece_chars: int = 0
    """Cut every txt/jsonl training document longer than this many characters into pieces of at most this
    size (at a space where possible), each a document of its own for the virtual streams and the validation
    holdout; 0 never cuts. ``train`` sets it (about one sequence of text) when the sources hold too few
    documents for a document-level holdout and the streams, e.g. one huge line: a sequence-level split."""


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
    """Final learning rate as a fraction of the peak."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay from peak to ``min_lr_ratio * lr`` after warm-up."""
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
    val_sequences: int = 64
    """Validation sequences (global, split across workers; the same set whatever the worker count)."""
    num_threads: int = 0
    """torch intra-op threads per worker; 0 divides the CPUs of the node among local workers."""
    activation_checkpointing: bool = False
    """Recompute block activations in the backward pass to save memory."""
    compile: Literal["auto", "yes", "no"] = "auto"
    """Compile each Transformer block with ``torch.compile`` (regional: embeddings, loss, optimizer stay eager).
    ``auto``: on for CUDA, off on CPU, where it costs a one-time compile of seconds per block shape and gains
    little at demo sizes (``./launch.sh bench`` measures both; see README). Layer dropout does not recompile."""
    stop_at_val_loss: float = 0.0
    """End the run (with its final checkpoint) at the first validation whose loss is at or below this; 0 never."""


@dataclass(kw_only=True)
class ZeroConfig:
    stage: int = 1
    """DeepSpeed ZeRO stage: 0 (plain data parallel), 1, 2 or 3."""
    offload_optimizer: bool = False
    """Offload optimizer state to CPU memory (stages 1-3, GPU runs)."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient reduction bucket."""
    overlap_comm: bool = False
    """Overlap gradient reduction with backward (GPU)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str = "checkpoints"
    """Root of checkpoints; each run writes ``DIR/RUN_ID/step_NNNNNNNN``. Must be shared by all nodes."""
    every_steps: int = 100
    """Commit a checkpoint every N steps (and always at the end); 0 only at the end."""
    keep_last: int = 0
    """Delete older committed checkpoints beyond the newest N; 0 keeps all."""
    resume_from: str = ""
    """A committed checkpoint directory to resume from (set by ``resume``)."""


@dataclass(kw_only=True)
class ClusterConfig:
    num_workers: int = 1
    """Training workers (processes). Each gets ``cpus_per_worker`` CPUs and one GPU when ``use_gpu``."""
    use_gpu: Literal["auto", "yes", "no"] = "auto"
    """``auto`` uses GPUs when the cluster has them."""
    cpus_per_worker: int = 1
    """CPUs reserved per worker in Ray."""
    address: str = ""
    """Ray address of an existing cluster; empty uses ``RAY_ADDRESS`` or starts an embedded local Ray."""
    max_failures: int = 0
    """Times Ray restarts a failed worker group (from the latest committed checkpoint)."""
    use_ray: bool = True
    """Run through Ray Train; false runs the training function in this process (or under torchrun)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement of the workers: PACK fills nodes first; SPREAD / STRICT_SPREAD put them on
    different nodes."""


@dataclass(kw_only=True)
class TrackingConfig:
    experiment: str = "pretrain"
    """MLflow experiment name."""
    run_name: str = ""
    """MLflow run name; empty uses the config name."""
    enabled: bool = True
    """Log to MLflow (the URI comes from ``MLFLOW_TRACKING_URI``, default ``sqlite:///mlflow.db``)."""


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


@dataclass(kw_only=True)
class StabilityConfig:
    """Training-stability monitoring and control (see ``pretrain/train/stability.py``).

    Every step, the all-reduced loss and pre-clipping gradient norm are checked before the optimizer
    step: non-finite values, spikes against rolling median/MAD statistics, and a rising loss trend.
    ``policy`` decides what an event does; every event is recorded in MLflow and the progress output."""

    policy: Literal["log", "skip", "rollback", "halt"] = "skip"
    """What a detected event does. ``log``: record only. ``skip``: drop the update of a non-finite or
    spiking step (weights and optimizer state untouched, the batch is consumed); a divergence is only
    logged. ``rollback``: skip non-finite steps; on a spike or divergence (or too many consecutive skips)
    restore the last good checkpoint, continue from the current data position (skipping the data window
    since that checkpoint) with a cooled-down LR. ``halt``: stop at the first event with a report.
    Default ``skip``, as OLMo-core's skip-step optimizer: cheap, and a false positive costs one batch."""
    health_every: int = 10
    """Log health metrics (per-block gradient/parameter norms, update/parameter ratios, activation RMS and
    max, attention logit max, output logit mean square, non-finite counts) every N steps; 0 disables."""
    window: int = 128
    """Rolling window (healthy steps) of the loss and gradient-norm statistics."""
    spike_threshold: float = 6.0
    """A loss or gradient norm more than this many robust sigmas (1.4826 * MAD) above the window median
    is a spike."""
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
    """After this many consecutive skipped steps escalate: ``rollback`` rolls back, ``skip`` halts."""
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


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture-of-Experts FFN (see ``pretrain/model/moe.py``): token-choice top-k routing, optional
    expert parallelism. ``num_experts: 0`` (the default) keeps every FFN dense."""

    num_experts: int = 0
    """Experts per MoE layer (0 = no MoE)."""
    top_k: int = 2
    """Experts each token is routed to."""
    every: int = 1
    """MoE FFN in blocks i with (i + 1) % every == 0 (Qwen-MoE's ``decoder_sparse_step``); the others stay dense."""
    layers: list[int] = field(default_factory=list)
    """Explicit 0-based block indices with an MoE FFN; when non-empty it replaces ``every``."""
    ffn_size: int = 0
    """Hidden size of each expert (0 = the dense FFN size of ``model``)."""
    capacity_factor: float = 0.0
    """Training-time capacity per expert = ceil(factor * tokens * top_k / num_experts) of each worker's
    micro-batch; assignments beyond it are dropped (the token keeps its residual), first choices before
    second. 0 = dropless. Evaluation and exported models are always dropless."""
    normalize_top_k: bool = True
    """Renormalize the top-k router probabilities to sum to 1 (Mixtral); false keeps the softmax values (OLMoE)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch load-balancing loss num_experts * sum_e f_e * p_e, summed over MoE layers."""
    router_z_loss_weight: float = 0.001
    """Weight of the router z-loss mean(logsumexp(router logits)^2), summed over MoE layers (ST-MoE)."""
    ep_size: int = 1
    """Expert-parallel degree: each worker holds num_experts / ep_size experts of every MoE layer and tokens
    travel by all-to-all; must divide num_experts and the worker count. 1 = experts replicated like dense weights."""
    collapse_share: float = 0.9
    """The stability monitor flags a router collapse when one expert of a layer receives more than this share of
    the layer's routed tokens for ``collapse_steps`` consecutive steps."""
    collapse_steps: int = 50
    """Consecutive steps of collapse before it is flagged (0 disables the check)."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE FFN."""
        if not self.enabled:
            return False
        if self.layers:
            return index in self.layers
        return (index + 1) % self.every == 0

    def validate(self, num_layers: int, num_workers: int, zero_stage: int) -> None:
        if self.num_experts < 0:
            raise ConfigError(f"moe.num_experts: must be >= 0, got {self.num_experts}")
        if not self.enabled:
            return
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"moe.top_k: must be in [1, moe.num_experts={self.num_experts}], got {self.top_k}")
        if self.every < 1:
            raise ConfigError(f"moe.every: must be >= 1, got {self.every}")
        for i, layer in enumerate(self.layers):
            if not 0 <= layer < num_layers:
                raise ConfigError(f"moe.layers[{i}]: block {layer} does not exist (model.num_layers={num_layers})")
        if not self.layers and self.every > num_layers:  # (i + 1) % every == 0 for no block i < num_layers
            raise ConfigError(f"moe.every: {self.every} selects no block of model.num_layers={num_layers}")
        for key, value in (("moe.ffn_size", self.ffn_size), ("moe.capacity_factor", self.capacity_factor),
                           ("moe.aux_loss_weight", self.aux_loss_weight),
                           ("moe.router_z_loss_weight", self.router_z_loss_weight),
                           ("moe.collapse_steps", self.collapse_steps)):
            if value < 0:
                raise ConfigError(f"{key}: must be >= 0, got {value}")
        if not 0.0 < self.collapse_share <= 1.0:
            raise ConfigError(f"moe.collapse_share: must be in (0, 1], got {self.collapse_share}")
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ConfigError(f"moe.ep_size: {self.ep_size} must divide moe.num_experts {self.num_experts}")
        if self.ep_size > 1 and zero_stage == 0:
            raise ConfigError(
                "zero.stage: expert parallelism (moe.ep_size > 1) needs ZeRO-1 or 2 (DeepSpeed's stage-0 gradient "
                "norm mis-weights expert-parallel gradients); use zero.stage 1 or 2, or moe.ep_size 1")
        if self.ep_size > 1 and zero_stage == 3:
            raise ConfigError(
                "zero.stage: ZeRO-3 cannot partition expert-parallel weights (moe.ep_size > 1); use zero.stage 1 "
                "or 2, or moe.ep_size 1 (experts are then sharded by ZeRO-3 like dense weights)")
        self.check_world_size(num_workers)

    def check_world_size(self, world_size: int) -> None:
        if self.enabled and world_size % self.ep_size:
            raise ConfigError(f"moe.ep_size: {self.ep_size} must divide the worker count {world_size} "
                              f"(cluster.num_workers)")


@dataclass(kw_only=True)
class LayerDropConfig:
    """Layer dropout (see ``pretrain/model/layerdrop.py``): in training each block (or each sub-layer) is skipped
    with probability ``rate``, decided from (seed, step, layer[, sample]) so every rank agrees with no
    communication. Off by default (``rate: 0``)."""

    rate: float = 0.0
    """Drop probability 1 - rho of a block or sub-layer at the end of the schedule (the deepest one with
    ``by_depth: linear``); 0 disables layer dropout."""
    mode: Literal["layer", "sample"] = "layer"
    """``layer``: the same blocks are skipped for the whole batch on every rank (a skipped block does no forward or
    backward work: LayerDrop / progressive layer dropping). ``sample``: stochastic depth, each sample's residual
    branch is dropped on its own (every block still runs)."""
    granularity: Literal["block", "sublayer"] = "block"
    """``block``: attention and FFN of a block are kept or dropped together; ``sublayer``: decided separately
    (eq. 95 of the reference text)."""
    by_depth: Literal["uniform", "linear"] = "uniform"
    """``uniform``: every block has ``rate``; ``linear``: block l of L has rate * (l + 1) / L (stochastic depth)."""
    schedule: Literal["constant", "linear", "progressive"] = "constant"
    """``constant``: ``rate`` from the first step; ``linear``: from 0 to ``rate`` over ``warmup_steps``;
    ``progressive``: progressive layer dropping, keep probability (1 - rate_bar) * exp(-gamma * t) + rate_bar with
    rate_bar = 1 - rate, i.e. the drop rate rises as rate * (1 - exp(-gamma * t))."""
    warmup_steps: int = 0
    """``schedule: linear``: steps to reach ``rate``."""
    gamma: float = 0.001
    """``schedule: progressive``: the rate's growth constant per step (PLD's gamma)."""
    scaling: Literal["inverted", "rho"] = "inverted"
    """``inverted`` (default): kept branches are scaled by 1/rho in training, nothing at inference, so the trained
    weights are the inference model as is (evaluation, export and pruning need no correction). ``rho``: eq. 95,
    nothing in training, every sub-layer output scaled by rho at inference (folded into the output projections on
    export, so standard Hugging Face classes load it)."""

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def validate(self) -> None:
        if not 0.0 <= self.rate < 1.0:
            raise ConfigError(f"layer_drop.rate: must be in [0, 1), got {self.rate}")
        if self.warmup_steps < 0:
            raise ConfigError(f"layer_drop.warmup_steps: must be >= 0, got {self.warmup_steps}")
        if self.schedule == "linear" and self.enabled and self.warmup_steps == 0:
            raise ConfigError("layer_drop.warmup_steps: schedule linear needs warmup_steps > 0")
        if self.gamma <= 0:
            raise ConfigError(f"layer_drop.gamma: must be > 0, got {self.gamma}")


@dataclass(kw_only=True)
class GrowthStep:
    """One growth of the model (see ``pretrain/model/growth.py``); empty fields leave that dimension alone."""

    at_step: int = 0
    """In ``growth.schedule``: grow after this many optimizer steps (the next step trains the grown model)."""
    depth: str = ""
    """Target number of blocks: ``2x`` (a factor), ``+N`` (more blocks; quote it in YAML) or ``N`` (a total)."""
    depth_op: Literal["stack", "interleave", "identity"] = "stack"
    """``stack``: the trained stack repeated (§4.2.2); ``interleave``: each block duplicated in place; ``identity``:
    new blocks whose residual branches start at zero (function-preserving, pre-norm and sandwich blocks)."""
    width: str = ""
    """Target hidden size (``2x``, ``+N``, ``N``); the heads (head size fixed) and the FFN grow by the same factor
    unless ``heads`` / ``ffn`` say otherwise."""
    width_op: Literal["tile", "net2net"] = "tile"
    """``tile``: eq. 111, integer factors, function-preserving; ``net2net``: any size, duplicated units."""
    heads: str = ""
    """Target number of attention heads (head size fixed, so the hidden size follows)."""
    ffn: str = ""
    """Target FFN size."""
    experts: int = 0
    """Dense -> MoE upcycling: every FFN becomes this many copies of itself with a zero router (0: no)."""
    top_k: int = 2
    """Experts per token after upcycling."""
    noise: float = 1e-3
    """Symmetry breaking: N(0, (noise * std(W))^2) on every grown or copied weight matrix; 0 disables."""


@dataclass(kw_only=True)
class GrowthConfig:
    """Model growth inside a running job (``schedule``); ``./launch.sh grow`` takes the same keys offline."""

    schedule: list[GrowthStep] = field(default_factory=list)
    """Growths, each at its ``at_step``."""
    optimizer: Literal["reset", "grow"] = "reset"
    """Optimizer state after a growth: ``reset`` (fresh AdamW moments for the grown model) or ``grow`` (the moments
    grown with the weights by the same operator: tiled and divided alike, copied with copied blocks; zero where the
    weights start at zero). ``grow`` needs ``moe.ep_size`` 1."""
    rewarm_steps: int = 0
    """After a growth, ramp the LR linearly from 0 back to the schedule over this many steps; 0 continues."""
    check_tolerance: float = 1e-4
    """A function-preserving growth without noise must change the loss on the held-back batch by at most this
    (relative), or the run stops with an error."""


@dataclass(kw_only=True)
class RunConfig:
    name: str = "run"
    """Name of this config (preset name), used for the MLflow run name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    layer_drop: LayerDropConfig = field(default_factory=LayerDropConfig)
    growth: GrowthConfig = field(default_factory=GrowthConfig)

    def validate(self) -> "RunConfig":
        """Cross-field checks; raises ConfigError naming the offending key."""
        m, d, t, c = self.model, self.data, self.train, self.cluster
        positive = {
            "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
            "model.num_heads": m.num_heads, "model.max_seq_len": m.max_seq_len,
            "train.max_steps": t.max_steps, "train.global_batch_size": t.global_batch_size,
            "train.micro_batch_size": t.micro_batch_size, "train.log_every": t.log_every,
            "cluster.num_workers": c.num_workers, "cluster.cpus_per_worker": c.cpus_per_worker,
            "data.num_streams": d.num_streams, "data.tokenizer_vocab_size": d.tokenizer_vocab_size,
            "data.tokenizer_train_docs": d.tokenizer_train_docs,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{key}: must be > 0, got {value}")
        nonneg = {
            "model.vocab_size": m.vocab_size, "model.num_kv_heads": m.num_kv_heads,
            "model.ffn_size": m.ffn_size, "train.warmup_steps": t.warmup_steps,
            "train.val_every": t.val_every, "train.val_sequences": t.val_sequences,
            "checkpoint.every_steps": self.checkpoint.every_steps,
            "checkpoint.keep_last": self.checkpoint.keep_last,
            "cluster.max_failures": c.max_failures, "train.num_threads": t.num_threads,
            "data.piece_chars": d.piece_chars, "model.init_std": m.init_std, "train.weight_decay": t.weight_decay,
            "train.eps": t.eps, "train.grad_clip": t.grad_clip, "growth.check_tolerance": self.growth.check_tolerance,
        }
        for key, value in nonneg.items():
            if value < 0:
                raise ConfigError(f"{key}: must be >= 0, got {value}")
        if t.global_batch_size > MAX_GLOBAL_BATCH:
            raise ConfigError(f"train.global_batch_size: {t.global_batch_size} is more than {MAX_GLOBAL_BATCH:,} "
                              f"sequences per step")
        if m.kind == "decoder" and m.max_seq_len < 2:
            raise ConfigError(f"model.max_seq_len: a decoder predicts the next token within a sequence, so it needs "
                              f"at least 2 tokens, got {m.max_seq_len}")
        self._validate_vocab()
        if m.hidden_size % m.num_heads:
            raise ConfigError(f"model.num_heads: {m.num_heads} does not divide model.hidden_size {m.hidden_size}")
        if (m.hidden_size // m.num_heads) % 2 and m.position == "rotary":
            raise ConfigError("model.num_heads: rotary positions need an even head dimension")
        kv = m.num_kv_heads or m.num_heads
        if m.num_heads % kv:
            raise ConfigError(f"model.num_kv_heads: {kv} does not divide model.num_heads {m.num_heads}")
        for key, p in (("model.dropout", m.dropout), ("model.attention_dropout", m.attention_dropout),
                       ("data.val_holdout", d.val_holdout)):
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"{key}: must be in [0, 1), got {p}")
        if m.kind == "encoder" and not 0.0 < d.mlm_probability < 1.0:
            raise ConfigError(f"data.mlm_probability: must be in (0, 1), got {d.mlm_probability}")
        if not d.sources:
            raise ConfigError("data.sources: at least one source is required")
        for i, s in enumerate([*d.sources, *d.val_sources]):
            if s.weight <= 0:
                raise ConfigError(f"data.sources[{i}].weight: must be > 0, got {s.weight}")
        if t.stop_at_val_loss < 0:
            raise ConfigError(f"train.stop_at_val_loss: must be >= 0, got {t.stop_at_val_loss}")
        if t.lr <= 0:
            raise ConfigError(f"train.lr: must be > 0, got {t.lr}")
        for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"{key}: must be in [0, 1), got {beta}")
        if m.position == "rotary" and m.rope_theta <= 0:
            raise ConfigError(f"model.rope_theta: must be > 0, got {m.rope_theta}")
        if not 0.0 <= t.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
        if t.global_batch_size % d.num_streams:
            raise ConfigError(
                f"train.global_batch_size: {t.global_batch_size} must be divisible by data.num_streams {d.num_streams}")
        if self.zero.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero.stage: must be 0, 1, 2 or 3, got {self.zero.stage}")
        self._validate_stability()
        self.moe.validate(m.num_layers, c.num_workers, self.zero.stage)
        self.layer_drop.validate()
        self._validate_growth()
        from pretrain.config.plan import make_plan  # the worker-count rules live with the derived numbers

        make_plan(self, c.num_workers)
        return self

    def _validate_vocab(self) -> None:
        m, d = self.model, self.data
        if d.tokenizer or m.init_from_hf:  # a given tokenizer: its size is known once it is loaded
            return
        if d.tokenizer_vocab_size < BYTE_LEVEL_VOCAB:
            raise ConfigError(f"data.tokenizer_vocab_size: {d.tokenizer_vocab_size} is below the {BYTE_LEVEL_VOCAB} "
                              f"tokens of a byte-level BPE (256 bytes and 4 special tokens)")
        # (model.vocab_size against the trained tokenizer is the driver's check: models are also built alone)

    def _validate_growth(self) -> None:
        g = self.growth
        if g.optimizer == "grow" and self.moe.ep_size > 1:
            raise ConfigError("growth.optimizer: grow gathers full optimizer moments, not with moe.ep_size > 1; "
                              "use growth.optimizer reset")
        if g.rewarm_steps < 0:
            raise ConfigError(f"growth.rewarm_steps: must be >= 0, got {g.rewarm_steps}")
        steps = [e.at_step for e in g.schedule]
        for i, e in enumerate(g.schedule):
            where = f"growth.schedule[{i}]"
            if not 0 < e.at_step < self.train.max_steps:
                raise ConfigError(f"{where}.at_step: must be in [1, train.max_steps), got {e.at_step}")
            if not (e.depth or e.width or e.heads or e.ffn or e.experts):
                raise ConfigError(f"{where}: grows nothing (set depth, width, heads, ffn or experts)")
            if e.noise < 0 or e.experts < 0:
                raise ConfigError(f"{where}: noise and experts must be >= 0")
            for name in ("depth", "width", "heads", "ffn"):
                spec = getattr(e, name)
                if spec and not _COUNT.fullmatch(spec):
                    raise ConfigError(f"{where}.{name}: {spec!r}: expected a factor like 2x, an increment like +4, "
                                      f"or a total")
        if steps != sorted(set(steps)):
            raise ConfigError("growth.schedule: at_step values must be increasing and distinct")

    def _validate_stability(self) -> None:
        s, m = self.stability, self.model
        if s.window < 8:
            raise ConfigError(f"stability.window: must be >= 8, got {s.window}")
        for key, value in (("stability.health_every", s.health_every), ("stability.warmup_steps", s.warmup_steps),
                           ("stability.divergence_window", s.divergence_window),
                           ("stability.good_after_steps", s.good_after_steps),
                           ("stability.max_rollbacks", s.max_rollbacks),
                           ("stability.lr_cooldown_steps", s.lr_cooldown_steps)):
            if value < 0:
                raise ConfigError(f"{key}: must be >= 0, got {value}")
        if 0 < s.divergence_window < 8:
            raise ConfigError(f"stability.divergence_window: must be 0 or >= 8, got {s.divergence_window}")
        if s.max_consecutive_skips < 1:
            raise ConfigError(f"stability.max_consecutive_skips: must be >= 1, got {s.max_consecutive_skips}")
        for key, value in (("stability.spike_threshold", s.spike_threshold),
                           ("stability.divergence_threshold", s.divergence_threshold)):
            if not value > 0:
                raise ConfigError(f"{key}: must be > 0, got {value}")
        if not 0.0 < s.lr_cooldown_factor <= 1.0:
            raise ConfigError(f"stability.lr_cooldown_factor: must be in (0, 1], got {s.lr_cooldown_factor}")
        if m.z_loss < 0:
            raise ConfigError(f"model.z_loss: must be >= 0, got {m.z_loss}")
        if m.embedding_scale < 0:
            raise ConfigError(f"model.embedding_scale: must be >= 0 (0 means sqrt(hidden_size)), "
                              f"got {m.embedding_scale}")
