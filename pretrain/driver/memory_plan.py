"""The memory one worker (one GPU) needs, from the config alone: what ``train --dry-run`` prints and judges.

A functional core. :func:`count_parameters` counts a shape-only (meta) model; :func:`layout_of` takes from the config
and its run plan what memory depends on (precision, ZeRO stage, data- and expert-parallel degrees, micro-batch,
recomputation); :func:`memory` turns them into bytes of weights, gradients, optimizer states and activations
(:mod:`pretrain.driver.memory_report` prints them and judges the total).

The formulas (docs/memory-plan.md) follow what our engine holds. DeepSpeed casts the module to bf16 (no autocast),
so weights, gradients and activations are in the compute dtype, except where the model computes in fp32 (RMSNorm's
input copy, attention's log-sum-exp, the loss over the logits). Its optimizer keeps fp32 master weights and the two
AdamW moments (12 bytes a parameter) under bf16; in fp32, ZeRO-1/2 still clone their fp32 partition (12 bytes),
ZeRO-3 and ZeRO-0 update the weights themselves (8 bytes). ZeRO-1/2/3 also reduce gradients through a buffer of
``zero.reduce_bucket_size`` elements, whatever the model's size. Activations are the tensors autograd keeps for the
backward, counted per token from the shapes of our blocks (``pretrain/model/layers.py``, ``moe.py``). The step's
peak is the larger of two moments: the backward's start (every kept activation, the logits and the loss's fp32
working set; under gradient accumulation the earlier micro-batches' gradients too) and the backward once this
micro-batch's gradients exist (the kept activations, the logits the step still holds, the gradients and the reduce
bucket, and with recomputation the block being rebuilt). Checked against the tensor memory training allocates on CPU
(``tests/integration/train/test_memory_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.config import ModelConfig, MoEConfig, RunConfig, RunPlan

GIB = float(1 << 30)
FIT_SHARE = 0.9
CUDA_CONTEXT = 1.0 * (1 << 30)
"""What a GPU worker holds outside torch's allocator (its CUDA context and loaded kernels, cuBLAS workspaces, NCCL's
communicator buffers), which ``torch.cuda.max_memory_allocated`` and so the plan's total leave out: the verdict adds
it before the 90 % share."""
"""A total above this share of the GPU's memory is "tight": the CUDA context, NCCL buffers and allocator
fragmentation usually take the rest."""
DS_PREFETCH = 2
"""ZeRO-3 holds the gathered 16-bit weights of the module it computes and of the one it prefetches."""


@dataclass(frozen=True)
class ParamCounts:
    total: int
    """Unique parameters (tied weights once), every expert."""
    body: int
    """Without token and position embeddings."""
    active: int
    """What one token passes through: MoE layers count their router and ``top_k`` experts."""
    expert: int
    """Parameters of all experts of all MoE layers (0 for a dense model)."""
    largest_gather: int
    """The largest block or embedding: what ZeRO-3 gathers at once."""
    split: int = 0
    """The dense blocks' attention and FFN projections: what tensor parallelism (AutoTP) splits."""


def count_parameters(cfg: RunConfig) -> ParamCounts:
    """The parameter counts of ``cfg``'s model, on a shape-only model (the meta device: no memory, milliseconds)."""
    import torch

    from pretrain.model import build_model
    from pretrain.model.counting import active_parameters, num_parameters
    from pretrain.model.layers import Attention, FeedForward
    from pretrain.model.moe import moe_layers

    with torch.device("meta"):
        model = build_model(cfg.model, cfg.train.seed, cfg.moe)
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return ParamCounts(
        total=num_parameters(model),
        body=num_parameters(model, exclude_embeddings=True),
        active=active_parameters(model),
        expert=sum(p.numel() for _, layer in moe_layers(model) for p in layer.experts.parameters()),
        largest_gather=max([*blocks, model.embed_tokens.weight.numel(), model.lm_head.weight.numel()]),
        split=sum(
            p.numel()
            for b in model.blocks
            for part in b.children()
            if isinstance(part, (Attention, FeedForward))  # not an MoE layer's experts
            for name, p in part.named_parameters()
            if name.split(".")[0] in SPLIT_PROJECTIONS
        ),
    )


SPLIT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The layers ``parallel.tensor`` splits (``pretrain/parallel/tensor.py``)."""


@dataclass(frozen=True)
class Layout:
    """What a worker's memory depends on besides the model."""

    precision: str
    """``bf16`` or ``fp32`` (``train.precision: auto`` is bf16 when the plan has GPUs)."""
    stage: int
    dp: int
    """Data-parallel degree (workers taking different sequences)."""
    ep: int
    """Expert-parallel degree (``parallel.expert``; 1 for dense models)."""
    micro_batch: int
    grad_accum: int
    seq_len: int
    recompute: str
    offload: bool
    gpus: bool
    """Whether the workers are GPUs (else CPU workers: the numbers are host memory)."""
    sp: int = 1
    """Sequence-parallel degree: each worker holds ``seq_len / sp`` tokens of every sequence."""
    tp: int = 1
    """Tensor-parallel degree: each worker holds ``1 / tp`` of the attention and FFN projections and their
    activations."""

    @property
    def zero_group(self) -> int:
        """Workers a ZeRO partition spans: DeepSpeed's data-parallel group, every worker of one tensor-parallel
        index (``dp x sp``)."""
        return self.dp * self.sp


def plans_gpus(cfg: RunConfig) -> bool:
    """GPU workers: ``cluster.use_gpu: yes``, or ``auto`` with a ``cluster.gpu_type`` named."""
    return cfg.cluster.use_gpu == "yes" or (cfg.cluster.use_gpu == "auto" and bool(cfg.cluster.gpu_type))


def layout_of(cfg: RunConfig, plan: RunPlan, gpus: bool | None = None) -> Layout:
    """The layout of ``cfg`` under ``plan``; ``gpus`` (default: :func:`plans_gpus`) decides ``precision: auto``."""
    gpus = plans_gpus(cfg) if gpus is None else gpus
    precision = cfg.train.precision if cfg.train.precision != "auto" else ("bf16" if gpus else "fp32")
    return Layout(
        precision=precision,
        stage=cfg.zero.stage,
        dp=plan.dims.data,
        ep=plan.dims.expert,
        micro_batch=plan.micro_batch,
        grad_accum=plan.grad_accum,
        seq_len=plan.seq_len,
        recompute=str(cfg.train.activation_checkpointing),
        offload=cfg.zero.offload_optimizer and cfg.zero.stage > 0,
        gpus=gpus,
        sp=plan.dims.sequence,
        tp=plan.dims.tensor,
    )


# ----------------------------------------------------------------------------------------------
# Activations: bytes per token that autograd keeps, block by block
# ----------------------------------------------------------------------------------------------


def _norm(m: ModelConfig, size: int, a: int, out: bool = True) -> int:
    """A norm over ``size`` features: RMSNorm keeps an fp32 copy of its input, the normalized input and 1/rms (fp32);
    LayerNorm its input, mean and 1/std. ``out``: its output too (kept by the linear layer that reads it)."""
    kept = 4 * size + a * size + 4 if m.norm == "rmsnorm" else a * size + 8
    return kept + (a * size if out else 0)


def _ffn(m: ModelConfig, size: int, a: int) -> int:
    """SwiGLU keeps gate, silu(gate), up and their product; GELU its input and output."""
    return (4 if m.activation == "swiglu" else 2) * a * size


def _moe(m: ModelConfig, moe: MoEConfig, size: int, a: int) -> int:
    """Per token: for each of its ``top_k`` assignments the token copy the experts read, the expert's FFN, its
    output and the weighted output; the fp32 router logits and probabilities (E each), and the routing indices and
    weights (about 32 bytes an assignment)."""
    k = moe.top_k
    return k * (3 * a * m.hidden_size + _ffn(m, size, a) + 32) + 8 * moe.num_experts + 8


def _stacked_experts(m: ModelConfig, moe: MoEConfig, lay: Layout, a: int) -> int:
    """Bytes per MoE layer, whatever the tokens: the grouped expert GEMM keeps a stacked copy of the local experts'
    weights for its backward."""
    per_expert = (3 if m.activation == "swiglu" else 2) * m.hidden_size * _expert_ffn(m, moe)
    return a * per_expert * moe.num_experts // lay.ep


def _block(m: ModelConfig, moe: MoEConfig | None, ffn: int, a: int, tp: int = 1) -> int:
    """Everything one block keeps (recompute ``none``). The two norms with their outputs (which pre-norm feed to
    attention and FFN, and post-norm to the next sub-layer); q, k and v (GQA's expanded to every head) and the
    attention output; the fp32 log-sum-exp per head; the FFN (or MoE); dropout masks (1 byte an element). Fused
    attention kernels keep no T x T matrix. Under tensor parallelism (``tp``) a worker keeps its heads' and its FFN
    columns' share; the norms see the whole hidden state."""
    d, h = m.hidden_size, m.num_heads
    kv = m.num_kv_heads or h
    inner = 4 * a * d + 4 * h + (_moe(m, moe, ffn, a) if moe is not None else _ffn(m, ffn, a))
    if m.qk_norm:
        inner += (h + kv) * _norm(m, d // h, a, out=False)
    b = 2 * _norm(m, d, a) + inner // tp
    if m.norm_placement == "sandwich":
        b += 2 * _norm(m, d, a, out=False)
    if m.dropout > 0:
        b += 2 * d
    return b


def _selective(m: ModelConfig, moe: MoEConfig | None, ffn: int, a: int, tp: int = 1) -> int:
    """What ``selective`` keeps of a block (``pretrain/model/recompute.py``): its input and the outputs of the
    matmuls and of attention (a ``tp`` share of the split ones)."""
    d, h = m.hidden_size, m.num_heads
    kv_dim = (m.num_kv_heads or h) * (d // h)
    gated = 2 if m.activation == "swiglu" else 1
    if moe is None:  # input, o_proj and down_proj outputs whole; q, k, v, attention out + lse, FFN columns split
        return 3 * a * d + (a * (d + 2 * kv_dim) + a * d + 4 * h + a * gated * ffn) // tp
    b = a * d + a * (d + 2 * kv_dim) + a * d + 4 * h + a * d  # input; q, k, v; attention out + lse; o_proj
    return b + a * moe.num_experts + moe.top_k * a * (gated * ffn + d)


def _dense_ffn(m: ModelConfig) -> int:
    from pretrain.model.transformer import resolved_ffn_size  # the model's own rule

    return resolved_ffn_size(m)


def _expert_ffn(m: ModelConfig, moe: MoEConfig) -> int:
    return moe.ffn_size or _dense_ffn(m)


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch at the two moments that can be the step's peak."""

    kept: float
    """What the blocks keep for the backward (all of it, or what recomputation keeps) and the embeddings'."""
    at_start: float
    """On top at the backward's start, before this micro-batch has a gradient: the head's activations, the logits
    and the loss's fp32 working set (log-softmax, its gradient, the logits' gradient)."""
    with_gradients: float
    """On top once gradients exist: the logits (the step holds the output) and the larger of the head's
    activations and one block rebuilt by recomputation."""

    @property
    def total(self) -> float:
        """The larger of the two."""
        return self.kept + max(self.at_start, self.with_gradients)


def activations(m: ModelConfig, moe: MoEConfig, lay: Layout) -> Activations:
    """Activation bytes of one micro-batch on one worker (``lay.micro_batch`` x ``lay.seq_len / lay.sp`` tokens)."""
    a = 2 if lay.precision == "bf16" else 4
    d, tokens = m.hidden_size, lay.micro_batch * lay.seq_len // lay.sp
    layers = [(moe if moe.is_moe_layer(i) else None) for i in range(m.num_layers)]
    ffns = [_expert_ffn(m, moe) if x else _dense_ffn(m) for x in layers]
    full = [_block(m, x, f, a, lay.tp) for x, f in zip(layers, ffns)]
    stacked = [_stacked_experts(m, moe, lay, a) if x else 0 for x in layers]  # not per token
    post = m.norm_placement in ("post", "deepnorm")
    emb = (_norm(m, d, a, out=post) if m.embedding_norm else (a * d if post else 0)) + (d if m.dropout > 0 else 0)
    head = _norm(m, d, a) if m.final_norm and not post else 0
    if m.mlm_head_transform:
        head += a * d + _norm(m, d, a)
    v = m.vocab_size
    if lay.recompute == "none":
        kept, rebuilt, layer_kept = full, [0], sum(stacked)
    else:
        kept = (
            [a * d] * len(full)
            if lay.recompute == "full"
            else [_selective(m, *xf, a, lay.tp) for xf in zip(layers, ffns)]
        )
        rebuilt = [tokens * (f - k) + s for f, k, s in zip(full, kept, stacked)]
        layer_kept = 0
    return Activations(
        kept=tokens * (sum(kept) + emb) + layer_kept,
        at_start=tokens * (head + v * (a + 12)),
        with_gradients=max(tokens * (a * v + head), tokens * a * v + max(rebuilt)),
    )


# ----------------------------------------------------------------------------------------------
# Per worker
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    weights: float
    gradients: float
    """The gradients and ZeRO's reduce bucket(s)."""
    optimizer: float
    """On the GPU (0 when offloaded: then ``host_optimizer``)."""
    activations: Activations
    accumulates: bool
    """Gradient accumulation: earlier micro-batches' gradients are alive at a backward's start."""
    host_optimizer: float = 0.0
    probe: float = 0.0
    """What the health probe adds on its steps (``stability.health_every``) beside the forward's activations: one
    head's fp32 attention scores and their masked copy (the attention logit max), or, after the forward, its fp32
    chunks of the output logits on top of the backward's start."""
    snapshot: float = 0.0
    """A health step's copies around the optimizer step (the update ratio): the weights this worker counts before
    the step and their differences after it, beside the gradients and optimizer states."""

    @property
    def total(self) -> float:
        """The peak: weights and optimizer states, and the larger of the backward's start (with earlier micro-batches'
        gradients under accumulation), the backward once this micro-batch's gradients exist, and a health step's
        probe; or a health step's optimizer step, the activations gone and the update ratio's copies made."""
        acts, grads = self.activations, self.gradients
        held = grads if self.accumulates else 0.0
        start = acts.at_start + held
        backward = acts.kept + max(start, acts.with_gradients + grads, self.probe + held)
        return self.weights + self.optimizer + max(backward, grads + self.snapshot)

    def parts(self) -> dict[str, float]:
        """Each component at its largest (their sum is at least :attr:`total`)."""
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations.total,
        }


def optimizer_bytes(precision: str, stage: int) -> int:
    """Bytes per parameter of the optimizer: fp32 master (bf16, or fp32 under ZeRO-1/2, which clone their
    partition) and the two AdamW moments."""
    return 12 if precision == "bf16" or stage in (1, 2) else 8


def held_and_shard(counts: ParamCounts, lay: Layout) -> tuple[float, float]:
    """The parameters a worker computes with (tensor parallelism: its share of the split ones; its experts only),
    and its ZeRO partition (experts: held / (dp / ep))."""
    dense = counts.total - counts.expert - counts.split + counts.split / lay.tp
    return dense + counts.expert / lay.ep, (dense + counts.expert) / lay.zero_group


def snapshot_params(counts: ParamCounts, lay: Layout) -> float:
    """The parameters the update ratio copies on the worker that counts the most (``pretrain/train/health.py``):
    its ZeRO-3 partition; below ZeRO-3 its share of the whole dense weights (dealt out over all workers by size),
    (over every worker, of every data, sequence and tensor rank) and whole its tensor-parallel shards (counted by
    the first tensor-parallel group) and its experts (by the first
    worker of each expert-data-parallel group)."""
    if lay.stage == 3:
        return held_and_shard(counts, lay)[1]
    split = counts.split if lay.tp > 1 else 0  # (without tensor parallelism nothing is a shard)
    return (counts.total - counts.expert - split) / (lay.dp * lay.sp * lay.tp) + split / lay.tp + counts.expert / lay.ep


def gradient_bytes(precision: str, stage: int) -> int:
    """Bytes per parameter of its gradient (``pretrain/train/engine.py``): fp32 4. bf16 sums micro-batches in fp32
    from ZeRO-1 on: ZeRO-1 keeps the bf16 gradient and its fp32 sum, both whole (6; DeepSpeed's BF16_Optimizer),
    ZeRO-2/3 an fp32 partition (4); ZeRO-0 adds in bf16 (2)."""
    if precision != "bf16":
        return 4
    return {0: 2, 1: 6}.get(stage, 4)


def memory(cfg: RunConfig, counts: ParamCounts, lay: Layout) -> Memory:
    """Bytes one worker holds. Experts: ``1/ep`` of them on each worker, their ZeRO partitions over the ``dp/ep``
    workers holding the same experts; dense weights partitioned over all ``dp``."""
    w = 2 if lay.precision == "bf16" else 4
    held, shard = held_and_shard(counts, lay)
    if lay.stage == 3:
        weights = w * (shard + min(DS_PREFETCH * counts.largest_gather, held))
    else:
        weights = w * held
    gradients = gradient_bytes(lay.precision, lay.stage) * (held if lay.stage < 2 else shard)
    gradients += REDUCE_BYTES * reduce_bucket(cfg, lay, held)
    opt = optimizer_bytes(lay.precision, lay.stage) * (held if lay.stage == 0 else shard)
    acts = activations(cfg.model, cfg.moe, lay)
    accumulates = lay.grad_accum > 1
    probe = health_probe(cfg, lay, acts) if cfg.stability.health_every > 0 else 0.0
    snapshot = 2 * w * snapshot_params(counts, lay) if cfg.stability.health_every > 0 else 0.0
    if lay.offload:
        return Memory(weights, gradients, 0.0, acts, accumulates, host_optimizer=opt, probe=probe, snapshot=snapshot)
    return Memory(weights, gradients, opt, acts, accumulates, probe=probe, snapshot=snapshot)


def health_probe(cfg: RunConfig, lay: Layout, acts: Activations) -> float:
    """Bytes of the health probe's copies (``pretrain/train/health.py``, ``Attention._logit_max``): 8 per element of
    one head's (b, T, T) scores (fp32, and masked when causal; attention sees the whole sequence under sequence
    parallelism), or the backward's start and two fp32 chunks of the output logits."""
    from pretrain.train.health import LOGIT_CHUNK

    v, tokens = cfg.model.vocab_size, lay.micro_batch * lay.seq_len // lay.sp
    chunk = min(max(1, LOGIT_CHUNK // v), tokens) * v  # elements of one fp32 chunk
    return max(8 * lay.micro_batch * lay.seq_len**2, acts.at_start + 8 * chunk)


REDUCE_BYTES = 4
"""Bytes of an element of the reduce buffers: gradients are reduced in fp32 (bf16 runs too)."""


def reduce_bucket(cfg: RunConfig, lay: Layout, held: float) -> float:
    """Elements of ZeRO's gradient reduce buffers: ``zero.reduce_bucket_size`` whatever the model's size (ZeRO-1/2
    from a step's first gradient to its update, two with ``overlap_comm``; ZeRO-3 for the whole run); none at 0.
    bf16 ZeRO-1 (BF16_Optimizer) reduces through the engine instead, which flattens up to 500M elements of the fp32
    gradients at a time (``held``: the gradients this worker holds)."""
    if lay.stage == 0:
        return 0
    if lay.stage == 1 and lay.precision == "bf16":
        return min(held, 500_000_000)
    return cfg.zero.reduce_bucket_size * (2 if cfg.zero.overlap_comm and lay.stage < 3 else 1)
