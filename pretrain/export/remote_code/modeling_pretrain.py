"""Self-contained Hugging Face modeling code for `pretrain` Transformers (``trust_remote_code=True``).

Used for configs without an exact standard Hugging Face class (sandwich norms, DeepNorm decoders,
pre-LN or RMSNorm encoders, biased decoders, ...). It is a copy of ``pretrain.model`` (same math, same
state-dict names: ``embed_tokens``, ``blocks.{i}.attn.q_proj``, ``lm_head`` ...), depending only on
torch and transformers, so an exported directory works without the `pretrain` package:

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)   # kind: decoder
    AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)   # kind: encoder

No KV cache: generation recomputes the (at most ``max_seq_len``) context at every step.
Padding masks (``attention_mask`` with zeros) are supported: a token's position counts the unmasked tokens before
it (``position_ids`` when given), so a left-padded prompt is the prompt alone (learned positions; rotary ones are
relative, so 0..T-1 gives the same scores).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput, MaskedLMOutput

_FIELDS = {
    "kind": "decoder", "max_seq_len": 128, "num_layers": 4, "hidden_size": 256, "num_heads": 4,
    "num_kv_heads": 0, "ffn_size": 1024, "activation": "gelu", "norm": "layernorm", "norm_placement": "pre",
    "norm_eps": 1e-5, "position": "rotary", "rope_theta": 10000.0, "tie_embeddings": True, "bias": False,
    "dropout": 0.0, "attention_dropout": 0.0, "init_std": 0.02, "embedding_norm": False, "final_norm": True,
    "mlm_head_transform": False, "deepnorm_depth": 0, "lm_head_bias": None,
    # Mixture-of-Experts (``pretrain.config.MoEConfig``): blocks listed in moe_layers have an MoE FFN.
    "moe_num_experts": 0, "moe_top_k": 2, "moe_layers": [], "moe_ffn_size": 0, "moe_normalize_top_k": True,
    "moe_selection_bias": False,
}


class PretrainTransformerConfig(PretrainedConfig):
    """The fields of ``pretrain.config.ModelConfig`` (``ffn_size`` resolved)."""

    model_type = "pretrain_transformer"
    attribute_map = {"num_attention_heads": "num_heads", "num_hidden_layers": "num_layers",
                     "max_position_embeddings": "max_seq_len", "intermediate_size": "ffn_size"}

    def __init__(self, vocab_size: int = 0, **kwargs):
        self.vocab_size = vocab_size
        for name, default in _FIELDS.items():
            setattr(self, name, kwargs.pop(name, default))
        kwargs.setdefault("tie_word_embeddings", self.tie_embeddings)
        super().__init__(**kwargs)


# ----------------------------------------------------------------------------------------------
# Layers (identical math to pretrain.model.layers)
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def make_norm(cfg) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, elementwise_affine=True, bias=cfg.bias)


def rope_cache(head_dim: int, seq_len: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    t = torch.arange(seq_len, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg, causal: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
        self.head_dim = cfg.hidden_size // self.num_heads
        self.causal = causal
        self.attention_dropout = cfg.attention_dropout
        d, kv_dim = cfg.hidden_size, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, kv_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(d, kv_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.bias)

    def forward(self, x, rope, key_mask):
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.num_kv_heads != self.num_heads:
            g = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
        p = self.attention_dropout if self.training else 0.0
        if key_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        else:
            allowed = key_mask[:, None, None, :].bool()  # (B, 1, 1, T)
            if self.causal:
                allowed = allowed & torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            # A fully masked row (a padding query) attends to itself instead of producing NaN.
            allowed = allowed | torch.eye(t, dtype=torch.bool, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, cfg, ffn_size: int | None = None) -> None:
        super().__init__()
        ffn_size = ffn_size or cfg.ffn_size
        self.gated = cfg.activation == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(cfg.hidden_size, ffn_size, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.hidden_size, ffn_size, bias=cfg.bias)
        self.down_proj = nn.Linear(ffn_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x):
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class _Holder(nn.Module):
    pass


class MoEFeedForward(nn.Module):
    """Dropless token-choice top-k MoE (identical math to pretrain.model.moe at inference): fp32 softmax,
    top-k, optional renormalization, weighted sum of the chosen experts accumulated in expert order."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.moe_num_experts, cfg.moe_top_k
        self.normalize_top_k = cfg.moe_normalize_top_k
        self.deepspeed_moe = _Holder()
        self.deepspeed_moe.gate = _Holder()
        self.deepspeed_moe.gate.wg = nn.Linear(cfg.hidden_size, cfg.moe_num_experts, bias=False)
        if cfg.moe_selection_bias:  # auxiliary-loss-free balancing: chooses the experts, not their weights
            self.deepspeed_moe.gate.register_buffer("expert_bias", torch.zeros(cfg.moe_num_experts))
        self.deepspeed_moe.experts = _Holder()
        self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(
            FeedForward(cfg, cfg.moe_ffn_size or cfg.ffn_size) for _ in range(cfg.moe_num_experts))

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        probs = self.deepspeed_moe.gate.wg(h).float().softmax(dim=-1)
        bias = getattr(self.deepspeed_moe.gate, "expert_bias", None)
        if bias is None:
            weights, chosen = probs.topk(self.top_k, dim=-1)
        else:
            chosen = (probs + bias.float()).topk(self.top_k, dim=-1).indices
            weights = probs.gather(-1, chosen)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        expert = chosen.t().reshape(-1)
        token = torch.arange(h.shape[0], device=h.device).repeat(self.top_k)
        weight = weights.t().reshape(-1)
        order = torch.argsort(expert, stable=True)
        expert, token, weight = expert[order], token[order], weight[order]
        counts = torch.bincount(expert, minlength=self.num_experts).tolist()
        ffns = self.deepspeed_moe.experts.deepspeed_experts
        y = torch.cat([ffn(p) for ffn, p in zip(ffns, h[token].split(counts))])
        y = (y * weight.unsqueeze(-1)).to(h.dtype)
        return torch.zeros_like(h).index_add_(0, token, y).view_as(x)


class Block(nn.Module):
    def __init__(self, cfg, causal: bool, moe: bool = False) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        self.alpha = (2.0 * (cfg.deepnorm_depth or cfg.num_layers)) ** 0.25 if self.placement == "deepnorm" else 1.0
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg, causal)
        self.norm2 = make_norm(cfg)
        self.ffn = MoEFeedForward(cfg) if moe else FeedForward(cfg)
        if self.placement == "sandwich":
            self.norm_out1 = make_norm(cfg)
            self.norm_out2 = make_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rope, key_mask):
        if self.placement == "pre":
            x = x + self.drop(self.attn(self.norm1(x), rope, key_mask))
            return x + self.drop(self.ffn(self.norm2(x)))
        if self.placement == "sandwich":
            x = x + self.drop(self.norm_out1(self.attn(self.norm1(x), rope, key_mask)))
            return x + self.drop(self.norm_out2(self.ffn(self.norm2(x))))
        x = self.norm1(self.alpha * x + self.drop(self.attn(x, rope, key_mask)))
        return self.norm2(self.alpha * x + self.drop(self.ffn(x)))


class HeadTransform(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.norm = make_norm(cfg)

    def forward(self, x):
        return self.norm(F.gelu(self.dense(x)))


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


class PretrainTransformerPreTrainedModel(PreTrainedModel):
    config_class = PretrainTransformerConfig
    base_model_prefix = "pretrain"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"lm_head.weight": "embed_tokens.weight"}

    def __init__(self, config: PretrainTransformerConfig) -> None:
        super().__init__(config)
        cfg = config
        self.causal = cfg.kind == "decoder"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.hidden_size) if cfg.position == "learned" else None
        self.embedding_norm = make_norm(cfg) if cfg.embedding_norm else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, self.causal, i in cfg.moe_layers) for i in range(cfg.num_layers))
        self.final_norm = (make_norm(cfg) if cfg.final_norm and cfg.norm_placement in ("pre", "sandwich")
                           else None)
        self.head_transform = HeadTransform(cfg) if cfg.mlm_head_transform else None
        head_bias = cfg.bias if cfg.lm_head_bias is None else cfg.lm_head_bias
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=head_bias)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.zero_()
        if isinstance(module, (nn.LayerNorm, RMSNorm)):
            module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.lm_head = value

    def _logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.config.max_seq_len}")
        key_mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            if position_ids is None and key_mask is not None:  # padding before a token is no position
                position_ids = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
            if position_ids is None:
                position_ids = torch.arange(t, device=input_ids.device)
            x = x + self.embed_positions(position_ids)
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        x = self.drop(x)
        rope = None
        if self.config.position == "rotary":
            # Computed per call (cheap) rather than stored: no non-persistent buffers to restore on load.
            rope = rope_cache(self.config.hidden_size // self.config.num_heads, t, self.config.rope_theta,
                              input_ids.device)
        for block in self.blocks:
            x = block(x, rope, key_mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.head_transform is not None:
            x = self.head_transform(x)
        return self.lm_head(x)


class PretrainTransformerForCausalLM(PretrainTransformerPreTrainedModel, GenerationMixin):
    """Causal LM (``kind: decoder``); ``labels`` are the inputs (shifted inside, like HF)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                **kwargs) -> CausalLMOutput:
        logits = self._logits(input_ids, attention_mask, position_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        n = self.config.max_seq_len  # no cache: the last max_seq_len tokens are the whole context
        mask = None if attention_mask is None else attention_mask[:, -n:]
        return {"input_ids": input_ids[:, -n:], "attention_mask": mask}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False


class PretrainTransformerForMaskedLM(PretrainTransformerPreTrainedModel):
    """Masked LM (``kind: encoder``); loss over ``labels != -100``."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                **kwargs) -> MaskedLMOutput:
        logits = self._logits(input_ids, attention_mask, position_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)
