"""The config tree: one dataclass per section (the capability sections moe, layer_drop, growth are in
capabilities.py; data and its sources in data.py; train in train.py; zero, checkpoint, cluster, parallel, tracking,
faults and stability in runtime.py), a docstring on every field, cross-field rules in :meth:`RunConfig.validate` (and
``MoEConfig.validate``; the rules of the parallel layout in ``pretrain/parallel/rules.py``). Strict loading lives in
``loading.py``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from pretrain.config.capabilities import GrowthConfig, LayerDropConfig, MoEConfig
from pretrain.config.data import DataConfig
from pretrain.config.errors import ConfigError
from pretrain.config.evaluation import EvalConfig
from pretrain.config.names import check_source_names
from pretrain.config.plan import RunPlan, layout
from pretrain.config.runtime import (
    CheckpointConfig,
    ClusterConfig,
    FaultsConfig,
    ParallelConfig,
    StabilityConfig,
    TrackingConfig,
    ZeroConfig,
    check_waits,
)
from pretrain.config.train import TrainConfig
from pretrain.parallel import rules  # a module, not its names: rules.py imports pretrain.config.errors
from pretrain.parallel.dims import ParallelDims

BYTE_LEVEL_VOCAB = 260
"""The smallest trained tokenizer: a byte-level BPE has the 256 bytes and 4 special tokens."""
MAX_GLOBAL_BATCH = 1 << 20
"""The most sequences per step we accept (the largest real runs take a few thousand)."""
MAX_SIZE = {
    "model.num_layers": 10_000,
    "model.hidden_size": 1 << 20,
    "model.ffn_size": 1 << 22,
    "model.vocab_size": 1 << 24,
    "model.max_seq_len": 1 << 24,
    "moe.num_experts": 4096,
    "moe.ffn_size": 1 << 22,
}
"""The largest sizes accepted: far beyond real models (126 blocks, width 16,384, 256k tokens, 1M-token contexts),
and small enough that a shape-only model of them is built in seconds and its tensor sizes fit int64."""


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
    with DeepNet's alpha/beta init scaling (Wang et al. 2022, arXiv:2203.00555). ``sandwich``: x + norm(f(norm(x)))
    (sub-LN style extra output norm, as in CogView/NormFormer)."""
    deepnorm_depth: int = 0
    """``deepnorm``: the depth N of DeepNet's constants, alpha = (2N)^(1/4) in every block and the init gain
    beta = (8N)^(-1/4); 0 means ``num_layers``. Depth growth sets it to the parent's N, so a copied block keeps
    computing exactly its source block's function (see docs/growth.md)."""
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
    lm_head_bias: bool | None = None
    """The output layer's bias; null follows ``bias``. GPT-2 has biases everywhere but there: ``bias: true`` with
    ``lm_head_bias: false`` exports as ``GPT2LMHeadModel``."""
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
    taken from it; the architecture fields above are then ignored, the training choices ``dropout``,
    ``attention_dropout``, ``init_std`` and ``z_loss`` kept). Its tokenizer is used too. A dense model: to train
    it with experts, start dense and upcycle (``grow RUN experts=N``)."""

    @property
    def output_bias(self) -> bool:
        """Whether the output layer has a bias (``lm_head_bias``, else ``bias``)."""
        return self.bias if self.lm_head_bias is None else self.lm_head_bias

    def ffn_width(self) -> int:
        """``ffn_size`` if set, else 4*D (GELU) or 8/3*D rounded up to a multiple of 64 (SwiGLU)."""
        if self.ffn_size > 0:
            return self.ffn_size
        if self.activation == "swiglu":
            return -(-int(8 * self.hidden_size / 3) // 64) * 64
        return 4 * self.hidden_size


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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    layer_drop: LayerDropConfig = field(default_factory=LayerDropConfig)
    growth: GrowthConfig = field(default_factory=GrowthConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self, steps_known: bool | None = None) -> RunConfig:
        """Cross-field checks; raises ConfigError naming the offending key. ``steps_known``: whether
        ``train.max_steps`` is the run's (default: unless ``train.max_flops`` will derive it when the run is
        created, which validates again with it); the checks against it wait till then."""
        known = not self.train.max_flops if steps_known is None else steps_known
        m, d, t, c = self.model, self.data, self.train, self.cluster
        positive = {
            "model.num_layers": m.num_layers,
            "model.hidden_size": m.hidden_size,
            "model.num_heads": m.num_heads,
            "model.max_seq_len": m.max_seq_len,
            "train.max_steps": t.max_steps,
            "train.global_batch_size": t.global_batch_size,
            "train.micro_batch_size": t.micro_batch_size,
            "train.log_every": t.log_every,
            "train.profile_steps": t.profile_steps,
            "cluster.num_workers": c.num_workers,
            "cluster.cpus_per_worker": c.cpus_per_worker,
            "data.num_streams": d.num_streams,
            "data.tokenizer_vocab_size": d.tokenizer_vocab_size,
            "data.tokenizer_train_docs": d.tokenizer_train_docs,
            "checkpoint.stop_timeout_s": self.checkpoint.stop_timeout_s,
            "model.norm_eps": m.norm_eps,
            "model.vocab_multiple": m.vocab_multiple,
            "model.init_std": m.init_std,
            "train.eps": t.eps,
            "zero.reduce_bucket_size": self.zero.reduce_bucket_size,
        }
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{key}: must be > 0, got {value}")
        for key, value in (
            ("model.num_layers", m.num_layers),
            ("model.hidden_size", m.hidden_size),
            ("model.ffn_size", m.ffn_size),
            ("model.vocab_size", m.vocab_size),
            ("model.max_seq_len", m.max_seq_len),
            ("moe.num_experts", self.moe.num_experts),
            ("moe.ffn_size", self.moe.ffn_size),
        ):
            if value > MAX_SIZE[key]:
                raise ConfigError(f"{key}: {value:,} is more than {MAX_SIZE[key]:,}, the most accepted")
        nonneg = {
            "model.vocab_size": m.vocab_size,
            "model.num_kv_heads": m.num_kv_heads,
            "model.ffn_size": m.ffn_size,
            "train.warmup_steps": t.warmup_steps,
            "train.val_every": t.val_every,
            "train.val_every_flops": t.val_every_flops,
            "train.max_flops": t.max_flops,
            "train.val_sequences": t.val_sequences,
            "checkpoint.every_steps": self.checkpoint.every_steps,
            "checkpoint.keep_last": self.checkpoint.keep_last,
            "faults.slow_checkpoint_s": self.faults.slow_checkpoint_s,
            "faults.slow_step_s": self.faults.slow_step_s,
            "cluster.max_failures": c.max_failures,
            "cluster.start_timeout": c.start_timeout,
            "train.num_threads": t.num_threads,
            "data.piece_chars": d.piece_chars,
            "data.shuffle_sequences": d.shuffle_sequences,
            "train.weight_decay": t.weight_decay,
            "train.grad_clip": t.grad_clip,
            "train.profile_at": t.profile_at,
            "growth.check_tolerance": self.growth.check_tolerance,
            "model.deepnorm_depth": m.deepnorm_depth,
            "zero.param_persistence_threshold": self.zero.param_persistence_threshold,
        }
        for key, value in nonneg.items():
            if value < 0:
                raise ConfigError(f"{key}: must be >= 0, got {value}")
        c.validate()
        rules.check_degrees(self.parallel)
        if c.cpus_per_worker > 1 and not float(c.cpus_per_worker).is_integer():
            raise ConfigError(
                f"cluster.cpus_per_worker: Ray reserves a fraction below 1 or a whole number of CPUs, "
                f"got {c.cpus_per_worker:g}"
            )
        check_waits(self.checkpoint, self.faults)
        if self.tracking.enabled and not self.tracking.experiment.strip():
            raise ConfigError("tracking.experiment: empty; name the MLflow experiment (default pretrain)")
        if t.global_batch_size > MAX_GLOBAL_BATCH:
            raise ConfigError(
                f"train.global_batch_size: {t.global_batch_size} is more than {MAX_GLOBAL_BATCH:,} sequences per step"
            )
        if m.kind == "decoder" and m.max_seq_len < 2:
            raise ConfigError(
                f"model.max_seq_len: a decoder predicts the next token within a sequence, so it needs "
                f"at least 2 tokens, got {m.max_seq_len}"
            )
        self._validate_vocab()
        if m.hidden_size % m.num_heads:
            raise ConfigError(f"model.num_heads: {m.num_heads} does not divide model.hidden_size {m.hidden_size}")
        if (m.hidden_size // m.num_heads) % 2 and m.position == "rotary":
            raise ConfigError("model.num_heads: rotary positions need an even head dimension")
        kv = m.num_kv_heads or m.num_heads
        if m.num_heads % kv:
            raise ConfigError(f"model.num_kv_heads: {kv} does not divide model.num_heads {m.num_heads}")
        for key, p in (
            ("model.dropout", m.dropout),
            ("model.attention_dropout", m.attention_dropout),
            ("data.val_holdout", d.val_holdout),
        ):
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"{key}: must be in [0, 1), got {p}")
        if m.kind == "encoder" and not 0.0 < d.mlm_probability < 1.0:
            raise ConfigError(f"data.mlm_probability: must be in (0, 1), got {d.mlm_probability}")
        if not d.sources:
            raise ConfigError("data.sources: at least one source is required")
        for key, i, s in [
            *(("data.sources", i, s) for i, s in enumerate(d.sources)),
            *(("data.val_sources", i, s) for i, s in enumerate(d.val_sources)),
        ]:
            if not 0 < s.weight < math.inf:  # (an infinite weight draws no other source: its pass never ends)
                raise ConfigError(f"{key}[{i}].weight: must be > 0 and finite, got {s.weight}")
            if not s.path.strip():  # Path("") is the working directory: every data file below it
                raise ConfigError(f"{key}[{i}].path: empty (a file, directory, glob or hub dataset name)")
        check_source_names(d.sources, d.val_sources)
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
        self.train.check_decay(known)
        if self.zero.stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero.stage: must be 0, 1, 2 or 3, got {self.zero.stage}")
        self._validate_stability()
        self.moe.validate(m.num_layers)
        rules.check_expert(self)
        rules.check_compile(self)
        rules.check_expert_world(self, c.num_workers)
        self.layer_drop.validate()
        self.layer_drop.early_exit.validate(m.num_layers, m.kind)
        self._validate_growth(known)
        self.eval.validate(bool(self.data.val_sources) or self.data.val_holdout > 0)
        make_plan(self, c.num_workers)  # the worker-count rules live with the derived numbers
        return self

    def _validate_vocab(self) -> None:
        m, d = self.model, self.data
        if d.tokenizer or m.init_from_hf:  # a given tokenizer: its size is known once it is loaded
            return
        if d.tokenizer_vocab_size < BYTE_LEVEL_VOCAB:
            raise ConfigError(
                f"data.tokenizer_vocab_size: {d.tokenizer_vocab_size} is below the {BYTE_LEVEL_VOCAB} "
                f"tokens of a byte-level BPE (256 bytes and 4 special tokens)"
            )
        # (model.vocab_size against the trained tokenizer is the driver's check: models are also built alone)

    def _validate_growth(self, steps_known: bool) -> None:
        g = self.growth
        rules.check_growth(self)
        if g.rewarm_steps < -1:
            raise ConfigError(f"growth.rewarm_steps: must be >= 0 (or -1: train.warmup_steps), got {g.rewarm_steps}")
        why = self.no_validation()
        if g.schedule and why:
            raise ConfigError(
                f"growth.schedule: every growth checks the loss on a held-back validation batch, but "
                f"{why}; set train.val_sequences > 0 and data.val_holdout > 0 (or data.val_sources)"
            )
        for i, e in enumerate(g.schedule):
            where = f"growth.schedule[{i}]"
            if e.at_tokens < 0 or not 0 <= e.at_fraction < 1:
                raise ConfigError(f"{where}: at_tokens must be >= 0 and at_fraction in (0, 1)")
            if e.at_tokens and e.at_fraction:
                raise ConfigError(f"{where}: set one of at_tokens and at_fraction (either gives at_step)")
            if e.fraction and not self.train.max_flops:
                raise ConfigError(
                    f"{where}.at_fraction: a fraction of the FLOPs budget needs train.max_flops > 0 "
                    "(or give the point as at_tokens or at_step)"
                    if e.at_fraction
                    else f"{where}: no growth point: set train.max_flops to grow at the default point (at_fraction "
                    f"{e.fraction:g} of the budget), or give at_step, at_tokens or at_fraction"
                )
            if not (e.derived_step and not e.at_step) and not 0 < e.at_step < (
                self.train.max_steps if steps_known else 2**63
            ):
                # (a derived at_step is set from at_tokens / at_fraction when the run is created)
                raise ConfigError(f"{where}.at_step: must be in [1, train.max_steps), got {e.at_step}")
            e.check(where, MAX_SIZE["moe.num_experts"])

    def no_validation(self) -> str:
        """Why the run never validates (no held-back data, or no validation sequences); "" when it does."""
        if not (self.data.val_sources or self.data.val_holdout > 0):
            return "data.val_holdout is 0 and data.val_sources is empty"
        return "train.val_sequences is 0" if self.train.val_sequences == 0 else ""

    def check_as_written(self) -> None:
        """The checks of a config as the user writes it (:func:`~pretrain.config.loading.load_config` without a
        stored base), not of a run's stored config, which a checkpoint, an export or a resume must still read
        whatever an older version accepted: each growth entry gives one point, the points of each kind come in
        order, and :meth:`check_settings`."""
        self.growth.check_given_points()
        self.growth.check_order()
        self.check_settings()

    def check_settings(self) -> None:
        """No setting would do nothing beside another one (refused in one line naming both), and the task files
        exist: of a config as written, and of a stored config given overrides (a resume, an anneal) that make
        such a conflict; never of a stored config only read (an export, an eval of a checkpoint)."""
        self.eval.check_files()
        self.moe.check_collapse_share()
        t, why = self.train, self.no_validation()
        for key, value in (
            ("train.stop_at_val_loss", t.stop_at_val_loss),
            ("train.val_every_flops", t.val_every_flops),
        ):
            if value and why:
                fix = (
                    "train.val_sequences > 0"
                    if why.startswith("train.")
                    else "data.val_holdout > 0 (or data.val_sources)"
                )
                raise ConfigError(
                    f"{key}: {value:g} needs validation, but {why} (never validated); set {fix} or {key} 0"
                )
        if self.zero.offload_optimizer and self.zero.stage == 0:
            raise ConfigError(
                "zero.offload_optimizer: ZeRO offloads the optimizer state at stages 1-3, not with zero.stage 0; "
                "set zero.stage 1, 2 or 3, or zero.offload_optimizer false"
            )
        if self.stability.policy == "rollback" and self.checkpoint.every_steps == 0:
            raise ConfigError(
                "stability.policy: rollback returns to a good checkpoint, but checkpoint.every_steps is 0 (one "
                "checkpoint, at the end), so every event would halt the run; set checkpoint.every_steps > 0"
            )

    def _validate_stability(self) -> None:
        s, m = self.stability, self.model
        if s.window < 8:
            raise ConfigError(f"stability.window: must be >= 8, got {s.window}")
        value: float  # the int settings, then the float ones
        for key, value in (
            ("stability.health_every", s.health_every),
            ("stability.warmup_steps", s.warmup_steps),
            ("stability.divergence_window", s.divergence_window),
            ("stability.good_after_steps", s.good_after_steps),
            ("stability.max_rollbacks", s.max_rollbacks),
            ("stability.lr_cooldown_steps", s.lr_cooldown_steps),
        ):
            if value < 0:
                raise ConfigError(f"{key}: must be >= 0, got {value}")
        if 0 < s.divergence_window < 8:
            raise ConfigError(f"stability.divergence_window: must be 0 or >= 8, got {s.divergence_window}")
        if s.max_consecutive_skips < 1:
            raise ConfigError(f"stability.max_consecutive_skips: must be >= 1, got {s.max_consecutive_skips}")
        for key, value in (
            ("stability.spike_threshold", s.spike_threshold),
            ("stability.divergence_threshold", s.divergence_threshold),
        ):
            if not value > 0:
                raise ConfigError(f"{key}: must be > 0, got {value}")
        if not 0.0 < s.lr_cooldown_factor <= 1.0:
            raise ConfigError(f"stability.lr_cooldown_factor: must be in (0, 1], got {s.lr_cooldown_factor}")
        if m.z_loss < 0:
            raise ConfigError(f"model.z_loss: must be >= 0, got {m.z_loss}")
        if m.embedding_scale < 0:
            raise ConfigError(
                f"model.embedding_scale: must be >= 0 (0 means sqrt(hidden_size)), got {m.embedding_scale}"
            )


def make_plan(cfg: RunConfig, world_size: int) -> RunPlan:
    """The plan of ``cfg`` on ``world_size`` workers (see ``plan.py``); a layout that cannot work is refused with a
    :class:`ConfigError` naming what to set."""
    t = cfg.train
    data_parallel = rules.check_model_parallel(cfg, world_size)
    plan = layout(
        world_size=data_parallel,
        global_batch=t.global_batch_size,
        micro_cap=t.micro_batch_size,
        num_streams=cfg.data.num_streams,
        seq_len=cfg.model.max_seq_len,
        val_sequences=t.val_sequences,
        workers=world_size,
    )
    rules.check_expert_world(cfg, world_size)
    return dataclasses.replace(plan, dims=ParallelDims.from_config(cfg, world_size))  # the one layout of the job
