"""Building blocks of the Transformer: norms, rotary embeddings, attention, FFN and the block.

Conventions follow Hugging Face Llama (module names ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
``gate_proj``/``up_proj``/``down_proj``, non-interleaved RoPE, ``repeat_kv`` GQA layout, fp32 RMSNorm)
so that a pre-norm RMSNorm/RoPE/SwiGLU decoder exports to ``LlamaForCausalLM`` by renaming keys.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from pretrain.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, exactly like HF ``LlamaRMSNorm``."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight multiply, as HF does (matters for bf16 parity).
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(cfg: ModelConfig, size: int | None = None) -> nn.Module:
    """The configured norm over ``size`` (default ``hidden_size``; LayerNorm has a bias iff ``cfg.bias``)."""
    size = cfg.hidden_size if size is None else size
    if cfg.norm == "rmsnorm":
        return RMSNorm(size, cfg.norm_eps)
    return nn.LayerNorm(size, eps=cfg.norm_eps, elementwise_affine=True, bias=cfg.bias)


def rope_cache(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables of shape (max_seq_len, head_dim), HF Llama default RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    t = torch.arange(max_seq_len, dtype=torch.int64, device=device).float()
    freqs = torch.outer(t, inv_freq)  # (S, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (S, hd): halves layout, not interleaved
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, hd) by cos/sin (T, hd); tables are cast to x's dtype like HF."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention through ``F.scaled_dot_product_attention``.

    ``cfg.qk_norm`` adds per-head norms ``q_norm``/``k_norm`` (over ``head_dim``, before RoPE). Setting
    ``probe_logits`` makes the next forwards also record ``last_logit_max``, the largest pre-softmax
    attention logit, from an explicit q.k^T on the side (health metrics); the SDPA path is unchanged.
    """

    def __init__(self, cfg: ModelConfig, causal: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
        if cfg.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"bad head counts: hidden {cfg.hidden_size}, heads {self.num_heads}, kv heads {self.num_kv_heads}"
            )
        self.head_dim = cfg.hidden_size // self.num_heads
        self.causal = causal
        self.attention_dropout = cfg.attention_dropout
        d, kv_dim = cfg.hidden_size, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, kv_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(d, kv_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.bias)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, self.head_dim)
            self.k_norm = make_norm(cfg, self.head_dim)
        self.qk_norm = cfg.qk_norm
        self.probe_logits = False
        self.last_logit_max: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, D)
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.ulysses is None:
            y = self.attend(q, k, v).transpose(1, 2)  # (B, T, H, hd)
        else:  # sequence parallel: x is this worker's slice; attention sees the whole sequence for H/N heads
            y = self.ulysses(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)  # (B, T, H, hd)
        return self.o_proj(y.reshape(b, t, -1))  # (B, T, H*hd) -> (B, T, D)

    @property
    def ulysses(self):
        """DeepSpeed's ``DistributedAttention`` around :meth:`attend` under sequence parallelism, else None."""
        return self.__dict__.get("_ulysses")

    def use_ulysses(self, attention) -> None:
        """Run attention through ``attention`` (see :attr:`ulysses`; None: locally). Kept out of the module tree (an
        ``nn.Module`` attribute would be registered as a submodule): it holds no parameters."""
        self.__dict__["_ulysses"] = attention

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scaled dot-product attention of (B, H, T, hd) queries over (B, KV, T, hd) keys and values -> (B, H, T, hd)
        (the head counts may be any multiple of each other: a worker's share under sequence or tensor parallelism)."""
        if k.shape[1] != q.shape[1]:
            # HF repeat_kv layout: query heads [j*g, (j+1)*g) share kv head j.
            g = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(g, dim=1)  # (B, H, T, hd)
            v = v.repeat_interleave(g, dim=1)  # (B, H, T, hd)
        if self.probe_logits:
            self.last_logit_max = self._logit_max(q, k)
        p = self.attention_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)  # (B, H, T, hd)

    @torch.no_grad()
    def _logit_max(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Largest scaled logit q.k/sqrt(hd) over the allowed (causal) positions, as an fp32 scalar. One head at a
        time: the fp32 (B, T, T) scores of one head (and their masked copy) are all it holds beside the forward."""
        t = q.shape[-2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1) if self.causal else None
        best = torch.full((), float("-inf"), device=q.device)
        for h in range(q.shape[1]):
            s = torch.matmul(q[:, h].float(), k[:, h].float().transpose(-1, -2)) * self.head_dim**-0.5  # (B, T, T)
            if mask is not None:
                s = s.masked_fill(mask, float("-inf"))
            best = torch.maximum(best, s.amax())
        return best


class FeedForward(nn.Module):
    """GELU MLP (``up_proj``/``down_proj``) or SwiGLU (``gate_proj``/``up_proj``/``down_proj``)."""

    def __init__(self, cfg: ModelConfig, ffn_size: int) -> None:
        super().__init__()
        self.gated = cfg.activation == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(cfg.hidden_size, ffn_size, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.hidden_size, ffn_size, bias=cfg.bias)
        self.down_proj = nn.Linear(ffn_size, cfg.hidden_size, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        if self.gated:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


def deepnorm_depth(cfg: ModelConfig) -> int:
    """N of DeepNet's alpha = (2N)^(1/4) and beta = (8N)^(-1/4): ``model.deepnorm_depth``, else the depth."""
    return cfg.deepnorm_depth or cfg.num_layers


class Block(nn.Module):
    """One Transformer layer; ``cfg.norm_placement`` picks how norms wrap the two sublayers."""

    def __init__(self, cfg: ModelConfig, ffn_size: int, causal: bool, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        # DeepNet residual up-weighting; a plain float so an exporter can fold it.
        self.alpha: float = (2.0 * deepnorm_depth(cfg)) ** 0.25 if self.placement == "deepnorm" else 1.0
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg, causal)
        self.norm2 = make_norm(cfg)
        self.ffn = ffn if ffn is not None else FeedForward(cfg, ffn_size)  # or an MoE FFN
        if self.placement == "sandwich":
            self.norm_out1 = make_norm(cfg)
            self.norm_out2 = make_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def branch_parameters(self, branch: str) -> list[nn.Parameter]:
        """The parameters only the ``attn`` or ``ffn`` residual branch uses (what a skipped sub-layer leaves without
        a gradient); post-norm blocks apply their norm whether or not the sub-layer runs."""
        mods = [self.attn] if branch == "attn" else [self.ffn]
        i = "1" if branch == "attn" else "2"
        if self.placement in ("pre", "sandwich"):
            mods += [m for m in (getattr(self, f"norm{i}"), getattr(self, f"norm_out{i}", None)) if m is not None]
        return [p for m in mods for p in m.parameters()]

    def skipped_parameters(self, attn_gate, ffn_gate) -> list[nn.Parameter]:
        """The parameters that get no gradient when the block runs with these gates: all of them when both
        sub-layers skip (the model does not call the block, so post-norm and DeepNorm norms do not run either),
        else the skipped sub-layers' :meth:`branch_parameters`."""
        if skips(attn_gate) and skips(ffn_gate):
            return list(self.parameters())
        return [
            p
            for branch, gate in (("attn", attn_gate), ("ffn", ffn_gate))
            if skips(gate)
            for p in self.branch_parameters(branch)
        ]

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, attn_gate=None, ffn_gate=None
    ) -> torch.Tensor:
        """x: (B, T, D) -> (B, T, D). A gate multiplies a sub-layer's residual branch: None runs it as is, 0.0 skips
        it (not computed), a float scales it, a (B,) tensor scales it per sample (see ``model/layerdrop.py``)."""
        if self.placement == "pre":
            if not skips(attn_gate):
                x = x + _gated(self.drop(self.attn(self.norm1(x), rope)), attn_gate)
            if not skips(ffn_gate):
                x = x + _gated(self.drop(self.ffn(self.norm2(x))), ffn_gate)
            return x
        if self.placement == "sandwich":
            if not skips(attn_gate):
                x = x + _gated(self.drop(self.norm_out1(self.attn(self.norm1(x), rope))), attn_gate)
            if not skips(ffn_gate):
                x = x + _gated(self.drop(self.norm_out2(self.ffn(self.norm2(x)))), ffn_gate)
            return x
        # post (alpha = 1) and deepnorm: norm(alpha * x + f(x)); a skipped sub-layer leaves norm(alpha * x)
        a = self.alpha * x
        x = self.norm1(a if skips(attn_gate) else a + _gated(self.drop(self.attn(x, rope)), attn_gate))
        a = self.alpha * x
        return self.norm2(a if skips(ffn_gate) else a + _gated(self.drop(self.ffn(x)), ffn_gate))


def skips(gate) -> bool:
    """A gate that skips its sub-layer (0.0; a per-sample tensor never skips the computation)."""
    return isinstance(gate, float) and gate == 0.0


def _gated(y: torch.Tensor, gate) -> torch.Tensor:
    if gate is None:
        return y
    if isinstance(gate, float):
        return y * gate
    # (B,) -> (B, 1, 1), on the activations' device: the gates are drawn by a CPU generator (the same on any device)
    return y * gate.to(device=y.device, dtype=y.dtype).view(-1, *([1] * (y.dim() - 1)))
