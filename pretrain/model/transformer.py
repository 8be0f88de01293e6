"""The configurable Transformer (causal decoder or masked-LM encoder), and building it (parameter and FLOP counts:
:mod:`pretrain.model.counting`).

State-dict keys: ``embed_tokens``, ``embed_positions`` (learned), ``embedding_norm``,
``blocks.{i}.{norm1,attn.{q,k,v,o}_proj,attn.{q,k}_norm,norm2,ffn.{gate,up,down}_proj,norm_out1,norm_out2}``,
``final_norm``, ``head_transform.{dense,norm}``, ``lm_head`` (its weight is ``embed_tokens.weight`` when tied). MoE
blocks have ``blocks.{i}.ffn.deepspeed_moe.{gate.wg,experts.deepspeed_experts.{e}.*}`` instead of the dense FFN (see
``pretrain/model/moe.py``). The RoPE tables are non-persistent buffers and never appear in checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pretrain.config import ModelConfig, MoEConfig
from pretrain.model.early_exit import exit_output, with_exits
from pretrain.model.layers import Attention, Block, FeedForward, RMSNorm, deepnorm_depth, make_norm, rope_cache, skips
from pretrain.model.moe import MoEFeedForward, prepare_experts
from pretrain.model.recompute import run_block
from pretrain.model.score import mean_cross_entropy


class SequenceShards(Protocol):
    """This worker's slice of every sequence under sequence parallelism: what the model asks of it. The
    implementation, with its collectives, is ``pretrain/parallel/sequence.py``."""

    def span(self, t: int) -> slice:
        """The positions of this worker's slice of a sequence of ``t`` tokens."""
        ...

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> this worker's (B, t, ...) slice."""
        ...

    def local_targets(self, labels: torch.Tensor, causal: bool) -> torch.Tensor:
        """The target of each of this worker's positions (decoders: the next token, across slice boundaries)."""
        ...

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This worker's share of the whole sequences' token-mean cross-entropy."""
        ...

    def token_mean(self, values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """This worker's share of the whole sequences' token mean of ``values`` over ``keep``."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, t, ...) slices of the group -> (B, T, ...), without gradient."""
        ...


class ModelOutput(NamedTuple):
    """A NamedTuple (not a dataclass) so DeepSpeed ZeRO-3's hooks can find the tensors inside."""

    loss: torch.Tensor | None
    """Scalar fp32 mean cross-entropy over labels != -100 (None without labels)."""
    logits: torch.Tensor
    """(B, T, V) in the compute dtype."""
    z_loss: torch.Tensor | None = None
    """The weighted z-loss term ``cfg.z_loss * mean(logsumexp(logits)^2)`` over the target positions, to be
    added to ``loss`` for the training objective (None without labels or when ``cfg.z_loss`` is 0)."""
    moe_loss: torch.Tensor | None = None
    """The weighted MoE auxiliary objective (load balancing + router z-loss) summed over the MoE layers that
    ran, to be added to ``loss`` for training (None for dense models)."""
    exit_loss: torch.Tensor | None = None
    """The weighted early-exit objective sum(weight * CE) over the forward's ``exits``, to be added to ``loss`` for
    training (None without exits; ``pretrain/model/early_exit.py``)."""
    exit_losses: torch.Tensor | None = None
    """(E,) fp32 mean cross-entropy of each exit, unweighted, in the order of ``exits`` (None without exits)."""
    exit_tokens: torch.Tensor | None = None
    """(E, B, T) greedy tokens of each exit, for forwards without gradients (validation); else None."""

    def objective(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The training objective: ``loss`` plus the z-loss and MoE terms that are present. ``weight`` multiplies
        the terms that are means over the targets (``loss``, ``z_loss``, ``exit_loss``), not the MoE terms (means
        over every routed token); a weight of exactly 1 gives the unweighted objective bit for bit."""
        total = self.loss
        assert total is not None  # the objective is taken of outputs with labels
        if weight is not None:
            total = total * weight
        for term, per_target in ((self.z_loss, True), (self.moe_loss, False), (self.exit_loss, True)):
            if term is not None:
                total = total + (term * weight if per_target and weight is not None else term)
        return total


def resolved_ffn_size(cfg: ModelConfig) -> int:
    """``cfg.ffn_size`` if set, else 4*D (GELU) or 8/3*D rounded up to a multiple of 64 (SwiGLU)."""
    return cfg.ffn_width()


class HeadTransform(nn.Module):
    """BERT's ``cls.predictions.transform``: dense -> GELU -> norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.norm = make_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        return self.norm(F.gelu(self.dense(x)))


class Transformer(nn.Module):
    """Token (+ learned position) embeddings -> N blocks -> optional final norm/head transform -> LM head.

    Constructing it directly leaves torch's default parameter init (fine before ``load_state_dict``);
    use :func:`build_model` for the configured, seeded init. ``moe``: MoE FFNs (None or ``num_experts: 0`` =
    dense), each built with all its experts (expert parallelism is applied from the training side).
    """

    def __init__(self, cfg: ModelConfig, moe: MoEConfig | None = None) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError(f"model.vocab_size must be resolved to > 0 before building, got {cfg.vocab_size}")
        self.cfg = cfg
        self.moe = moe if moe is not None else MoEConfig()
        self.causal = cfg.kind == "decoder"
        self.activation_checkpointing: str = "none"  # none | full | selective (pretrain/model/recompute.py)
        # This worker's slice of each sequence under sequence parallelism (pretrain/parallel/sequence.py)
        self.sequence_shards: SequenceShards | None = None
        # Per block (attention, FFN) output scales used when no gates are given and not training: the rho of
        # Xiao and Zhu's eq. 95 (arXiv:2311.17633, sec. 4.2.4; see pretrain/model/layerdrop.py) for layer dropout
        # with ``rho`` scaling (set from the training side; an exporter folds them).
        self.branch_scales: list[tuple[float, float]] | None = None
        d = cfg.hidden_size
        self.head_dim = d // cfg.num_heads

        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, d) if cfg.position == "learned" else None
        self.embedding_norm = make_norm(cfg) if cfg.embedding_norm else None
        # A plain float (no buffer): checkpoints stay unchanged and an exporter can fold it.
        self.embedding_scale: float = cfg.embedding_scale or math.sqrt(d)
        self.drop = nn.Dropout(cfg.dropout)
        ffn = resolved_ffn_size(cfg)
        expert_ffn = self.moe.ffn_size or ffn
        self.blocks = nn.ModuleList(
            Block(
                cfg, ffn, self.causal, MoEFeedForward(cfg, self.moe, expert_ffn) if self.moe.is_moe_layer(i) else None
            )
            for i in range(cfg.num_layers)
        )
        # post/deepnorm blocks already end with a norm.
        self.final_norm = make_norm(cfg) if cfg.final_norm and cfg.norm_placement in ("pre", "sandwich") else None
        self.head_transform = HeadTransform(cfg) if cfg.mlm_head_transform else None
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=cfg.output_bias)
        self.tie_weights()
        self.rope_cos: torch.Tensor | None
        self.rope_sin: torch.Tensor | None
        self.register_buffer("rope_cos", None, persistent=False)
        self.register_buffer("rope_sin", None, persistent=False)
        self.reset_buffers()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding Parameter (again, e.g. after ``to_empty``)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def reset_buffers(self) -> None:
        """(Re)compute the fp32 RoPE tables on the device of the parameters."""
        if self.cfg.position != "rotary":
            return
        device = self.embed_tokens.weight.device
        if device.type == "meta":  # shapes only (meta kernels of the math would import torch._dynamo)
            shape = (self.cfg.max_seq_len, self.head_dim)
            self.rope_cos, self.rope_sin = torch.empty(shape, device=device), torch.empty(shape, device=device)
            return
        cos, sin = rope_cache(self.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=device)
        self.rope_cos, self.rope_sin = cos, sin  # (S, hd) each

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Deterministic init drawing only from ``generator`` (module order is fixed by construction).

        Default: N(0, init_std) for Linear/Embedding weights, with o_proj/down_proj further scaled by
        1/sqrt(2L) (GPT-2); DeepNet: xavier_normal_ with gain beta on v/o/FFN, 1 on q/k. Biases 0, norms 1.
        """
        cfg = self.cfg
        std = cfg.init_std
        deepnorm = cfg.norm_placement == "deepnorm"
        beta = (8.0 * deepnorm_depth(cfg)) ** -0.25
        residual_std = std / math.sqrt(2.0 * cfg.num_layers)
        done: set[int] = set()  # a tied weight is initialized once (as the embedding)
        lin: nn.Linear | None
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, RMSNorm)):
                if module.weight is not None:
                    module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    cast(torch.Tensor, module.bias).zero_()
            elif isinstance(module, nn.Embedding):
                if id(module.weight) not in done:
                    module.weight.normal_(0.0, std, generator=generator)
                    done.add(id(module.weight))
            elif isinstance(module, Attention) and deepnorm:
                for lin, gain in (
                    (module.q_proj, 1.0),
                    (module.k_proj, 1.0),
                    (module.v_proj, beta),
                    (module.o_proj, beta),
                ):
                    nn.init.xavier_normal_(lin.weight, gain=gain, generator=generator)
                    done.add(id(lin.weight))
            elif isinstance(module, MoEFeedForward):
                self._init_experts(module, generator, done)
                if module.selection_bias is not None:
                    module.selection_bias.zero_()  # balanced start; draws nothing
            elif isinstance(module, FeedForward) and id(module.up_proj.weight) in done:
                pass  # an expert, initialized with its MoE layer
            elif isinstance(module, FeedForward) and deepnorm:
                for lin in (getattr(module, "gate_proj", None), module.up_proj, module.down_proj):
                    if lin is not None:
                        nn.init.xavier_normal_(lin.weight, gain=beta, generator=generator)
                        done.add(id(lin.weight))
            elif isinstance(module, Attention):
                for lin in (module.q_proj, module.k_proj, module.v_proj):
                    lin.weight.normal_(0.0, std, generator=generator)
                    done.add(id(lin.weight))
                module.o_proj.weight.normal_(0.0, residual_std, generator=generator)
                done.add(id(module.o_proj.weight))
            elif isinstance(module, FeedForward):
                for lin in (getattr(module, "gate_proj", None), module.up_proj):
                    if lin is not None:
                        lin.weight.normal_(0.0, std, generator=generator)
                        done.add(id(lin.weight))
                module.down_proj.weight.normal_(0.0, residual_std, generator=generator)
                done.add(id(module.down_proj.weight))
            elif isinstance(module, nn.Linear):
                if id(module.weight) not in done:  # head_transform.dense, untied lm_head
                    module.weight.normal_(0.0, std, generator=generator)
                    done.add(id(module.weight))
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
        # Attention/FeedForward are visited before their Linear children, which then see `done`.

    def _init_experts(self, moe: MoEFeedForward, generator: torch.Generator, done: set[int]) -> None:
        """Each expert gets its own draws, in global expert order, whichever experts this worker holds
        (others are drawn into scratch tensors), so every expert-parallel layout has the same weights."""
        cfg = self.cfg
        deepnorm = cfg.norm_placement == "deepnorm"
        std, beta = cfg.init_std, (8.0 * deepnorm_depth(cfg)) ** -0.25
        residual_std = std / math.sqrt(2.0 * cfg.num_layers)
        template = moe.experts[0]
        for g in range(moe.num_experts):
            local = moe.first_expert <= g < moe.first_expert + moe.num_local_experts
            ffn = moe.experts[g - moe.first_expert] if local else None
            for name in ("gate_proj", "up_proj", "down_proj"):
                if not hasattr(template, name):
                    continue
                w = getattr(ffn, name).weight if ffn is not None else torch.empty_like(getattr(template, name).weight)
                if deepnorm:
                    nn.init.xavier_normal_(w, gain=beta, generator=generator)
                else:
                    w.normal_(0.0, residual_std if name == "down_proj" else std, generator=generator)
                done.add(id(w))

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        layer_mask: Sequence[bool] | None = None,
        gates: Sequence[tuple] | None = None,
        exits: Sequence[tuple[int, float]] | None = None,
    ) -> ModelOutput:
        """input_ids/labels: (B, T) int64; ``layer_mask[i]`` False skips block i (identity); ``gates[i]`` =
        (attention gate, FFN gate) of block i (layer dropout, see ``Block.forward`` and ``model/layerdrop.py``);
        ``exits``: (depth E, weight) of the early exits whose losses to compute (``model/early_exit.py``)."""
        b, t = input_ids.shape
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        if layer_mask is not None and len(layer_mask) != len(self.blocks):
            raise ValueError(f"layer_mask has {len(layer_mask)} entries for {len(self.blocks)} blocks")
        if gates is not None and len(gates) != len(self.blocks):
            raise ValueError(f"gates has {len(gates)} entries for {len(self.blocks)} blocks")
        exit_at = dict(sorted(exits or ()))  # in depth order, as the blocks run
        if exit_at and (labels is None or not all(0 < d < len(self.blocks) for d in exit_at)):
            raise ValueError(f"exits {sorted(exit_at)} need labels and depths in 1..{len(self.blocks) - 1}")
        if gates is None and self.branch_scales is not None and not self.training:
            gates = self.branch_scales
        sp = self.sequence_shards
        span = slice(0, t) if sp is None else sp.span(t)  # this worker's positions
        if sp is not None:
            input_ids = sp.local(input_ids)  # (B, t)

        x = self.embed_tokens(input_ids)  # (B, t, D)
        if self.embedding_scale != 1.0:
            x = x * self.embedding_scale
        if self.embed_positions is not None:
            positions = torch.arange(span.start, span.stop, device=input_ids.device)
            x = x + self.embed_positions(positions)  # + (t, D)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        x = self.drop(x)

        rope = None
        if self.rope_cos is not None and self.rope_sin is not None:
            rope = (self.rope_cos[span], self.rope_sin[span])  # (t, hd) each: global positions
        recompute = self.activation_checkpointing if self.training and torch.is_grad_enabled() else "none"
        if recompute != "none":  # the grouped-matmul probe runs a forward and backward: not inside a recomputed block
            prepare_experts(self, x)
        moe_terms, exit_outs = [], []
        for i, block in enumerate(self.blocks):
            if i in exit_at:  # the exit after the first i blocks
                assert labels is not None
                exit_outs.append(exit_output(self, x, labels))
            if layer_mask is not None and not bool(layer_mask[i]):
                continue
            attn_gate, ffn_gate = gates[i] if gates is not None else (None, None)
            if skips(attn_gate) and skips(ffn_gate):
                continue  # a dropped block: no work at all
            x = run_block(recompute, block, x, rope, attn_gate, ffn_gate)  # (B, T, D)
            if isinstance(block.ffn, MoEFeedForward) and not skips(ffn_gate):
                assert block.ffn.aux_loss is not None  # set by the forward that just ran
                moe_terms.append(block.ffn.aux_loss)
                block.ffn.commit_stats()

        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.head_transform is not None:
            x = self.head_transform(x)
        logits = self.lm_head(x)  # (B, t, V)
        moe_loss = torch.stack(moe_terms).sum() if labels is not None and moe_terms else None
        if sp is not None:
            out = self._sequence_parallel_output(sp, logits, labels, moe_loss)
        else:
            loss = None if labels is None else self.loss(logits, labels)
            z_loss = None
            if labels is not None and self.cfg.z_loss > 0:
                z_loss = self.cfg.z_loss * self.z_term(logits, labels)
            out = ModelOutput(loss=loss, logits=logits, z_loss=z_loss, moe_loss=moe_loss)
        return with_exits(out, list(exit_at.values()), exit_outs) if exit_outs else out

    def _sequence_parallel_output(
        self, sp: SequenceShards, logits: torch.Tensor, labels: torch.Tensor | None, moe_loss: torch.Tensor | None
    ) -> ModelOutput:
        """The output of a sequence-parallel forward (see ``pretrain/parallel/sequence.py``): losses as the
        worker's share of the whole sequences' token means; logits of this worker's slice (B, t, V), or gathered to
        (B, T, V) without gradients (a scorer compares them with whole-sequence labels). MoE layers route each token
        on its own; their auxiliary objective (``moe_loss``) is of this worker's tokens, as with data parallelism."""
        loss = z_loss = None
        if labels is not None:
            target = sp.local_targets(labels, self.causal)  # (B, t)
            loss = sp.cross_entropy(logits, target)
            if self.cfg.z_loss > 0:
                keep = (target != -100).float()
                z_loss = self.cfg.z_loss * sp.token_mean(torch.logsumexp(logits.float(), dim=-1).pow(2), keep)
        if not torch.is_grad_enabled():
            logits = sp.gather(logits)  # (B, T, V)
        return ModelOutput(loss=loss, logits=logits, z_loss=z_loss, moe_loss=moe_loss)

    def z_term(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 mean of logsumexp(logits)^2 over the positions that have a target (PaLM z-loss)."""
        if self.causal:
            logits, labels = logits[:, :-1], labels[:, 1:]  # (B, T-1, V), (B, T-1)
        keep = (labels != -100).float()  # (B, T')
        lse = torch.logsumexp(logits.float(), dim=-1)  # (B, T')
        return (lse.pow(2) * keep).sum() / keep.sum().clamp(min=1.0)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """fp32 mean CE over labels != -100 (decoders predict token t+1 from position t); a micro-batch without
        any target gives 0 (not NaN) so it cannot poison accumulation. The scorer's definition (``score.py``)."""
        return mean_cross_entropy(logits, labels, self.causal)


def build_model(
    cfg: ModelConfig, seed: int, moe: MoEConfig | None = None, weights: dict[str, torch.Tensor] | None = None
) -> Transformer:
    """The model of ``cfg``: freshly initialized (same cfg and seed give bitwise identical weights; every expert
    gets its own draws, so an expert-parallel worker's slice equals the same experts of this model), or holding
    ``weights`` (a full state dict, every expert; a tied ``lm_head.weight`` may be absent), whose tensors it
    then uses as its parameters (no copy, no wasted init).

    The module tree is built on the meta device (so torch's default inits draw nothing from the
    global RNG and cost nothing), then materialized on the default device and initialized from a
    local generator, or assigned ``weights``.
    """
    device = torch.get_default_device()
    with torch.device("meta"), SkipInitOnMeta():
        model = Transformer(cfg, moe)
    if weights is not None:
        if cfg.tie_embeddings and "lm_head.weight" not in weights and "embed_tokens.weight" in weights:
            weights = {**weights, "lm_head.weight": weights["embed_tokens.weight"]}
        model.load_state_dict(weights, strict=True, assign=True)
        model.tie_weights()
        model.reset_buffers()
        return model
    if device.type == "meta":  # shape-only model, e.g. for counting
        return model
    model.to_empty(device=device)
    model.tie_weights()  # to_empty replaces Parameters, which unties them
    model.reset_buffers()
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    model.init_weights(generator)
    return model


class SkipInitOnMeta(TorchFunctionMode):
    """Skips ``torch.nn.init``'s in-place inits of meta tensors (a module's default init while it is built on the
    meta device): they would draw nothing anyway, but their meta kernels are torch's Python references, whose
    wrappers import ``torch._dynamo`` (a slow import, paid at every worker's start) for an eager model that never
    needs it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_"):  # in-place inits
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)
