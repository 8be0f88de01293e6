"""The config sections of the capabilities built on the training core: Mixture-of-Experts (``moe``), layer
dropout (``layer_drop``) and model growth (``growth``), each with its own rules. Part of the tree
(``tree.py`` holds the core sections and ``RunConfig``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from pretrain.config.errors import ConfigError, quote


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
    """Renormalize the top-k router probabilities to sum to 1 (Mixtral); false keeps the softmax values (OLMoE).
    Not with ``top_k: 1``, whatever this says: one renormalized weight is p/p = 1, which gives the router no
    gradient from the loss; top-1 weights each token's expert by its probability (Switch Transformer)."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch Transformer load-balancing loss num_experts * sum_e f_e * p_e (Fedus et al. 2021,
    arXiv:2101.03961), summed over MoE layers (not applied with ``balance: bias``)."""
    balance: Literal["aux_loss", "bias", "both"] = "aux_loss"
    """How the load is balanced: ``aux_loss`` (the Switch loss above), ``bias`` (auxiliary-loss-free, DeepSeek-V3:
    a per-expert bias added to the router probabilities for the top-k selection only, not to the combine weights,
    nudged after every step by ``bias_rate * sign(mean load - load_e)`` from the load summed over all ranks; a
    buffer saved with the model) or ``both``."""
    bias_rate: float = 0.001
    """``balance: bias|both``: the per-step bias update (DeepSeek-V3's gamma; the biases add to probabilities)."""
    router_z_loss_weight: float = 0.001
    """Weight of the router z-loss mean(logsumexp(router logits)^2), summed over MoE layers (ST-MoE: Zoph et al.
    2022, arXiv:2202.08906)."""
    collapse_share: float = 0.9
    """The stability monitor flags a router collapse when more than this share of a layer's tokens are routed to
    one expert (among their ``top_k``) for ``collapse_steps`` consecutive steps. A balanced router gives each expert
    ``top_k / num_experts``, which this must exceed; not checked with ``top_k == num_experts`` (no choice)."""
    collapse_steps: int = 50
    """Consecutive steps of collapse before it is flagged (0 disables the check)."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    @property
    def renormalizes(self) -> bool:
        """Whether the top-k weights are renormalized (``normalize_top_k``, never for top-1: see there)."""
        return self.normalize_top_k and self.top_k > 1

    @property
    def selection_bias(self) -> bool:
        """Whether MoE layers carry the auxiliary-loss-free routing bias (``balance: bias|both``)."""
        return self.enabled and self.balance != "aux_loss"

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE FFN."""
        if not self.enabled:
            return False
        if self.layers:
            return index in self.layers
        return (index + 1) % self.every == 0

    def validate(self, num_layers: int) -> None:
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
        for key, value in (
            ("moe.ffn_size", self.ffn_size),
            ("moe.capacity_factor", self.capacity_factor),
            ("moe.aux_loss_weight", self.aux_loss_weight),
            ("moe.router_z_loss_weight", self.router_z_loss_weight),
            ("moe.collapse_steps", self.collapse_steps),
            ("moe.bias_rate", self.bias_rate),
        ):
            if value < 0:
                raise ConfigError(f"{key}: must be >= 0, got {value}")
        if self.balance != "aux_loss" and self.bias_rate <= 0:
            raise ConfigError(f"moe.bias_rate: must be > 0 with moe.balance={self.balance}, got {self.bias_rate}")
        if not 0.0 < self.collapse_share <= 1.0:
            raise ConfigError(f"moe.collapse_share: must be in (0, 1], got {self.collapse_share}")

    def check_collapse_share(self) -> None:
        """``collapse_share`` above a balanced router's share (of a config as written: a stored one keeps loading
        whatever an older version took)."""
        balanced = self.top_k / self.num_experts if self.enabled else 0.0
        if self.collapse_steps and self.enabled and self.top_k < self.num_experts and self.collapse_share <= balanced:
            raise ConfigError(
                f"moe.collapse_share: {self.collapse_share} is not above a balanced router's share of the tokens "
                f"(moe.top_k / moe.num_experts = {balanced:g}): every step would be a collapse; raise it, or "
                "moe.collapse_steps=0 turns the check off"
            )


@dataclass(kw_only=True)
class EarlyExitConfig:
    """Early-exit training (LayerSkip: Elhoushi et al. 2024, arXiv:2404.16710; see ``pretrain/model/early_exit.py``):
    the hidden state after the first E blocks goes through the model's own final norm and LM head, and its
    cross-entropy, weighted, is added to the training objective, so the first E blocks learn to predict (a draft
    for self-speculative decoding). Exits are named by E, the number of blocks they run (1 .. depth - 1; the full
    depth is the main loss). Decoders only. Off by default (``layers: ''``)."""

    layers: str | list[int] = ""
    """The exits: ``''`` (none: off), ``all`` (every depth 1 .. L-1), ``every:N`` (depths N, 2N, ... below L; after a
    growth the new depths join), or a list of depths (each 1 .. model.num_layers - 1)."""
    scale: float = 1.0
    """The exits' weight: exit E adds ``scale * e(E) / e(L) * CE_E`` to the objective, e(E) = 1 + 2 + ... + E
    (LayerSkip's depth-growing scale relative to the final layer, whose loss keeps weight 1)."""
    curriculum: Literal["none", "rotational", "gradual"] = "none"
    """Which exits train at a step (LayerSkip's curricula): ``none``: all of them every step; ``rotational``:
    one in every ``rotation`` of the exits (in depth order), the set moving by one each step; ``gradual``: exits
    switch on from the deepest down, exit E from 0-based step ``gradual_fraction * train.max_steps * (L - E + 1) /
    L`` (all on at ``gradual_fraction`` of the run; ``train.max_steps`` as first planned, kept across resumes). A
    function of the step and the depth only."""
    rotation: int = 2
    """``curriculum: rotational``: each exit trains at one step in ``rotation`` (LayerSkip's R)."""
    gradual_fraction: float = 0.5
    """``curriculum: gradual``: the fraction of ``train.max_steps`` (as first planned) by which every exit is on."""

    @property
    def enabled(self) -> bool:
        return self.layers not in ("", [])

    def validate(self, num_layers: int, kind: str) -> None:
        """Values (each named by its path), against the model's starting depth and kind."""
        where = "layer_drop.early_exit"
        if isinstance(self.layers, str):
            spec = self.layers
            every = spec[6:] if spec.startswith("every:") else None
            # (N is not bounded by the starting depth: exits join as a growth deepens the model)
            if spec not in ("", "all") and not (
                every is not None and every.isascii() and every.isdecimal() and int(every) >= 1
            ):
                raise ConfigError(
                    f"{where}.layers: expected '', 'all', 'every:N' (N >= 1) or a list of depths; got {spec!r}"
                )
        else:
            bad = [d for d in self.layers if not 1 <= d < num_layers]
            if bad or len(set(self.layers)) != len(self.layers):
                raise ConfigError(
                    f"{where}.layers: depths must be distinct and in 1..{num_layers - 1} (model.num_layers "
                    f"{num_layers}; the full depth is the main loss); got {self.layers}"
                )
        if self.scale <= 0:
            raise ConfigError(f"{where}.scale: must be > 0, got {self.scale}")
        if self.rotation < 1:
            raise ConfigError(f"{where}.rotation: must be >= 1, got {self.rotation}")
        if not 0.0 < self.gradual_fraction <= 1.0:
            raise ConfigError(f"{where}.gradual_fraction: must be in (0, 1], got {self.gradual_fraction}")
        if self.enabled and kind != "decoder":
            raise ConfigError(
                f"{where}.layers: early-exit training is for decoders (model.kind {kind}); set layers to '' "
                "or model.kind decoder"
            )


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
    backward work: LayerDrop, Fan et al. 2019, arXiv:1909.11556; progressive layer dropping, Zhang and He 2020,
    arXiv:2010.13369). ``sample``: stochastic depth (Huang et al. 2016, arXiv:1603.09382), each sample's residual
    branch is dropped on its own (every block still runs)."""
    granularity: Literal["block", "sublayer"] = "block"
    """``block``: attention and FFN of a block are kept or dropped together; ``sublayer``: decided separately
    (sub-layer dropout: T. Xiao and J. Zhu, "Introduction to Transformers: an NLP Perspective", arXiv:2311.17633,
    sec. 4.2.4, eq. 95)."""
    by_depth: Literal["uniform", "linear"] = "uniform"
    """``uniform``: every block has ``rate``; ``linear``: block l of L has rate * (l + 1) / L (stochastic depth's
    linear decay rule, Huang et al. 2016, arXiv:1603.09382)."""
    schedule: Literal["constant", "linear", "progressive"] = "constant"
    """``constant``: ``rate`` from the first step; ``linear``: from 0 to ``rate`` over ``warmup_steps``;
    ``progressive``: progressive layer dropping (Zhang and He 2020, arXiv:2010.13369), keep probability
    (1 - rate_bar) * exp(-gamma * t) + rate_bar with rate_bar = 1 - rate, i.e. the drop rate rises as
    rate * (1 - exp(-gamma * t))."""
    warmup_steps: int = 0
    """``schedule: linear``: steps to reach ``rate``."""
    gamma: float = 0.001
    """``schedule: progressive``: the rate's growth constant per step (PLD's gamma)."""
    scaling: Literal["inverted", "rho"] = "inverted"
    """``inverted`` (default): kept branches are scaled by 1/rho in training, nothing at inference, so the trained
    weights are the inference model as is (evaluation, export and pruning need no correction). ``rho``: Xiao and
    Zhu's eq. 95 (arXiv:2311.17633, sec. 4.2.4), nothing in training, every sub-layer output scaled by rho at
    inference (folded into the output projections on export, so standard Hugging Face classes load it)."""
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    """Early-exit training (LayerSkip), alone or with the layer dropout above (LayerSkip's recipe: ``by_depth:
    linear``, so the deep blocks drop most)."""

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


DEFAULT_GROWTH_FRACTION = 0.1
"""The growth point of an entry that gives none (as ``at_fraction`` of ``train.max_flops``): grown early, as in the
published G_stack recipe (Du et al. 2024; why not from ``bench --growth``: ``docs/growth.md``)."""
DEFAULT_GROWTH_DEPTH = "4x"
"""The target of an entry (or ``./launch.sh grow``) that gives none: a quarter of the depth stacked four times,
G_stack's published growth factor (``docs/growth.md``)."""


_COUNT = re.compile(r"\s*(\d+(\.\d+)?x|\+\d+|\d+)\s*")  # growth targets: 2x, 1.5x, +4, 12


@dataclass(kw_only=True)
class GrowthStep:
    """One growth of the model (see ``pretrain/model/growth.py``); empty fields leave that dimension alone.

    ``depth``, ``width``, ``heads`` and ``ffn`` are targets: ``2x`` (a factor), ``+N`` (N more) or ``N`` (a total).
    Without any target (nor ``experts``) an entry (and ``./launch.sh grow``) stacks the depth 4x, and without
    ``at_step``, ``at_tokens`` or ``at_fraction`` it grows at ``at_fraction`` 0.1 of ``train.max_flops``:
    the published G_stack recipe (growth factor 4, grown early; ``docs/growth.md`` says what was measured here).
    A number may be written as a YAML int (``depth: 8`` is a total of 8 blocks; stored as the text ``'8'``), and an
    unquoted ``+4`` is an increment like ``'+4'`` (the config loader keeps ``+N`` as text)."""

    at_step: int = 0
    """In ``growth.schedule``: grow after this many optimizer steps (the next step trains the grown model). Derived
    (and printed) when ``at_tokens`` or ``at_fraction`` is set."""
    at_tokens: int = 0
    """In ``growth.schedule``: grow once the smaller model has trained on this many tokens (rounded up to whole
    steps); G_stack (Du et al. 2024, arXiv:2405.15319) states its growth point in tokens."""
    at_fraction: float = 0.0
    """In ``growth.schedule``: grow once this fraction of ``train.max_flops`` is spent (rounded up to whole steps);
    the FLOPs of every model before it counted at its size."""
    depth: str | int = ""
    """Target number of blocks: ``2x`` (a factor), ``+N`` (N more blocks) or ``N`` (a total)."""
    depth_op: Literal["stack", "interleave", "identity"] = "stack"
    """``stack``: the trained stack repeated (shallow-to-deep stacking: T. Xiao and J. Zhu, "Introduction to
    Transformers: an NLP Perspective", arXiv:2311.17633, sec. 4.2.2; G_stack: Du et al. 2024, arXiv:2405.15319);
    ``interleave``: each block duplicated in place; ``identity``: new blocks whose residual branches start at zero
    (function-preserving, pre-norm and sandwich blocks)."""
    width: str | int = ""
    """Target hidden size (``2x``, ``+N``, ``N``); the heads (head size fixed) and the FFN grow by the same factor
    unless ``heads`` / ``ffn`` say otherwise."""
    width_op: Literal["tile", "net2net"] = "tile"
    """``tile``: Xiao and Zhu's eq. 111 (arXiv:2311.17633, sec. 4.4), integer factors, function-preserving;
    ``net2net``: any size, duplicated units (Net2Net: Chen et al. 2016, arXiv:1511.05641; exact for the FFN size
    only)."""
    heads: str | int = ""
    """Target number of attention heads (head size fixed, so the hidden size follows)."""
    ffn: str | int = ""
    """Target FFN size."""
    experts: int = 0
    """Dense -> MoE upcycling: every FFN becomes this many copies of itself with a zero router (0: no)."""
    top_k: int = 2
    """Experts per token after upcycling."""
    noise: float = 1e-3
    """Symmetry breaking: N(0, (noise * std(W))^2) on every grown or copied weight matrix; 0 disables."""

    TARGETS = ("depth", "width", "heads", "ffn")

    @property
    def fraction(self) -> float:
        """``at_fraction``, or the default point when the entry gives no point at all."""
        return self.at_fraction or (0.0 if self.at_step or self.at_tokens else DEFAULT_GROWTH_FRACTION)

    @property
    def derived_step(self) -> bool:
        """Whether ``at_step`` is derived (from ``at_tokens``, ``at_fraction`` or the default point)."""
        return bool(self.at_tokens or self.fraction)

    def check(self, where: str, max_experts: int) -> None:
        """Refuse, naming ``where`` (``growth.schedule[i]``, ``grow``), what no model grows by: a negative noise or
        expert count, more experts than ``max_experts``, a ``top_k`` outside them, a target that is not a count."""
        if self.noise < 0 or self.experts < 0:
            raise ConfigError(f"{where}: noise and experts must be >= 0")
        if self.experts > max_experts:
            raise ConfigError(f"{where}.experts: {self.experts:,} is more than {max_experts:,}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"{where}.top_k: must be in [1, experts={self.experts}], got {self.top_k}")
        for name in self.TARGETS:
            spec, shown = str(getattr(self, name)), quote(str(getattr(self, name)))
            if spec and not _COUNT.fullmatch(spec):
                raise ConfigError(
                    f"{where}.{name}: {shown}: expected a factor like 2x, an increment like +4, or a total like 8"
                )
            if spec and float(spec.strip().lstrip("+").rstrip("x")) == 0:
                raise ConfigError(f"{where}.{name}: {shown} grows nothing (leave the key out instead)")

    def __post_init__(self) -> None:
        for name in self.TARGETS:  # an int N (e.g. YAML ``depth: 8``) is the total N, kept as text like ``'8'``
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, str(value))
        if not any(getattr(self, name) != "" for name in self.TARGETS) and not self.experts:
            self.depth = DEFAULT_GROWTH_DEPTH  # the study's recipe: a quarter of the depth, stacked


@dataclass(kw_only=True)
class GrowthConfig:
    """Model growth inside a running job (``schedule``); ``./launch.sh grow`` takes the same keys offline."""

    schedule: list[GrowthStep] = field(default_factory=list)
    """Growths, each at its ``at_step``, ``at_tokens`` or ``at_fraction`` (by default ``at_fraction`` 0.1 of
    ``train.max_flops``)."""
    optimizer: Literal["reset", "grow"] = "reset"
    """Optimizer state after a growth: ``reset`` (fresh AdamW moments for the grown model) or ``grow`` (the moments
    transformed like the grown model's gradients, m' = T(m) and v' = T^2(v): for ``tile`` by k, g/k for internal
    matrices, embeddings, norms and biases, g for the LM head and routers; copied with stacked blocks; zero for new
    ``identity`` blocks; see ``docs/growth.md``). ``grow`` needs ``parallel.expert`` 1."""
    rewarm_steps: int = -1
    """After a growth, ramp the LR linearly from 0 back to the schedule over this many steps; 0 continues; -1 (the
    default): ``train.warmup_steps`` (fresh AdamW moments, re-warmed; ``docs/growth.md``).
    A run derived by ``./launch.sh grow`` gets it set (its ``rewarm=`` option; by default the parent's value when
    positive, else the parent's ``train.warmup_steps``: the child starts with fresh AdamW moments) and re-warms from
    its first step."""

    def check_order(self) -> None:
        """The growth points of each kind (``at_step``, once set or given alone; ``at_tokens``; ``at_fraction``)
        strictly increase along the schedule; the first that does not is refused naming both entries. (Points of
        different kinds are compared once resolved into steps: ``pretrain/driver/budget.py``.)"""
        for kind in ("at_step", "at_tokens", "at_fraction"):
            points = [(i, getattr(e, kind)) for i, e in enumerate(self.schedule) if getattr(e, kind)]
            for (i, a), (j, b) in zip(points, points[1:]):
                if b <= a:
                    raise ConfigError(
                        f"growth.schedule[{j}]: {kind} {b!r} is not after growth.schedule[{i}]'s {a!r}; "
                        "the growths must come in order, each at a later point"
                    )

    def check_given_points(self) -> None:
        """A schedule as written (a config file and overrides, not a run's resolved config, which records the
        ``at_step`` derived beside ``at_tokens`` / ``at_fraction``): each entry gives at most one growth point."""
        for i, e in enumerate(self.schedule):
            if e.at_step and (e.at_tokens or e.at_fraction):
                other = "at_tokens" if e.at_tokens else "at_fraction"
                raise ConfigError(
                    f"growth.schedule[{i}]: at_step {e.at_step} and {other} {getattr(e, other)!r} both give the "
                    f"growth point; set one ({other} is resolved into at_step when the run is created)"
                )

    def rewarm(self, warmup_steps: int) -> int:
        """The re-warm in steps (``rewarm_steps``, with -1 resolved to the run's ``warmup_steps``)."""
        return warmup_steps if self.rewarm_steps < 0 else self.rewarm_steps

    check_tolerance: float = 1e-4
    """A function-preserving growth without noise must change the loss on the held-back batch (computed in fp32) by
    at most this (relative), or the run stops with an error. A schedule needs held-back data:
    ``train.val_sequences`` > 0 and ``data.val_holdout`` > 0 or ``data.val_sources``."""
