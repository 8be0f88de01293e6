"""Tests of pretrain.model.transformer: option grid, masking semantics, init, HF Llama parity, the FFN size."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.config import ModelConfig
from pretrain.model import ModelOutput, Transformer, build_model, resolved_ffn_size

V, D, L, T, B = 97, 32, 2, 16, 2


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=V, hidden_size=D, num_layers=L, num_heads=4, max_seq_len=T)
    base.update(kw)
    return ModelConfig(**base)


def tokens(seed: int = 0, b: int = B, t: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, t), generator=g)


def mlm_labels(ids: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Keep about half the positions as targets, the rest -100 (at least one per row)."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(ids.shape, generator=g) < 0.5
    keep[:, 0] = True
    return torch.where(keep, ids, torch.full_like(ids, -100))


# ----------------------------------------------------------------------------------------------
# Option grid: forward/backward
# ----------------------------------------------------------------------------------------------

GRID = list(
    itertools.product(
        ["decoder", "encoder"],
        ["pre", "post", "deepnorm", "sandwich"],
        ["layernorm", "rmsnorm"],
        ["learned", "rotary"],
        ["gelu", "swiglu"],
        [True, False],
    )
)


def grid_cfg(kind, placement, norm, position, activation, tied) -> ModelConfig:
    # Secondary options ride along with the main axes so each one is covered both ways.
    return tiny(
        kind=kind,
        norm_placement=placement,
        norm=norm,
        position=position,
        activation=activation,
        tie_embeddings=tied,
        num_kv_heads=2 if position == "rotary" else 0,  # GQA
        bias=position == "learned",  # BERT-style biases
        embedding_norm=kind == "encoder" and position == "learned",
        mlm_head_transform=kind == "encoder" and activation == "gelu",
        final_norm=not (placement == "sandwich" and norm == "layernorm"),
        dropout=0.1,
        attention_dropout=0.1,
    )


@pytest.mark.parametrize(
    "kind,placement,norm,position,activation,tied", GRID, ids=["-".join(map(str, c)) for c in GRID]
)
def test_forward_backward_grid(kind, placement, norm, position, activation, tied):
    cfg = grid_cfg(kind, placement, norm, position, activation, tied)
    model = build_model(cfg, seed=0).train()
    ids = tokens()
    labels = ids if kind == "decoder" else mlm_labels(ids)
    out = model(ids, labels=labels)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (B, T, V)
    assert out.loss is not None and out.loss.dim() == 0 and out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)
    # An untrained model is close to uniform over the vocabulary.
    assert abs(out.loss.item() - math.log(V)) < 1.0
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert (model.embed_positions is not None) == (position == "learned")
    has_final = cfg.final_norm and placement in ("pre", "sandwich")
    assert (model.final_norm is not None) == has_final
    assert hasattr(model.blocks[0], "norm_out1") == (placement == "sandwich")
    assert hasattr(model.blocks[0].ffn, "gate_proj") == (activation == "swiglu")
    assert (model.blocks[0].attn.q_proj.bias is not None) == cfg.bias
    assert model.blocks[0].attn.k_proj.out_features == (cfg.num_kv_heads or cfg.num_heads) * (D // 4)
    # Without labels: no loss, logits only.
    with torch.no_grad():
        assert model.eval()(ids).loss is None


def test_dropout_is_active_only_in_training():
    model = build_model(tiny(dropout=0.2, attention_dropout=0.2), seed=0)
    ids = tokens()
    model.train()
    a, b = model(ids).logits, model(ids).logits
    assert not torch.allclose(a, b)
    model.eval()
    assert torch.equal(model(ids).logits, model(ids).logits)


# ----------------------------------------------------------------------------------------------
# Attention direction and loss masking
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("position", ["learned", "rotary"])
@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_causality(kind, position):
    model = build_model(tiny(kind=kind, position=position), seed=0).eval()
    ids = tokens()
    t = 9
    changed = ids.clone()
    changed[:, t] = (ids[:, t] + 1) % V
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    diff = (a - b).abs().amax(dim=(0, 2))  # (T,)
    assert diff[t:].min() > 1e-4  # the changed position and (decoder) later ones see it
    if kind == "decoder":
        assert diff[:t].max() < 1e-6
    else:
        assert diff[:t].min() > 1e-4  # bidirectional: every earlier position sees it


def test_decoder_loss_shifts_and_ignores_minus_100():
    model = build_model(tiny(kind="decoder"), seed=0)
    ids = tokens()
    labels = ids.clone()
    labels[0, 3:7] = -100
    labels[1, -1] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].float()  # position t predicts label t+1
    target = labels[:, 1:]
    keep = target != -100
    manual = F.cross_entropy(logits[keep], target[keep])
    torch.testing.assert_close(out.loss, manual, rtol=1e-6, atol=1e-6)
    # The first label is never a target after the shift.
    labels2 = labels.clone()
    labels2[:, 0] = (labels[:, 0] + 1) % V
    assert torch.equal(model(ids, labels=labels2).loss, out.loss)


def test_encoder_loss_no_shift_and_ignores_minus_100():
    model = build_model(tiny(kind="encoder", position="learned", bias=True), seed=0)
    ids = tokens()
    labels = mlm_labels(ids)
    out = model(ids, labels=labels)
    keep = labels != -100
    manual = F.cross_entropy(out.logits.float()[keep], labels[keep])
    torch.testing.assert_close(out.loss, manual, rtol=1e-6, atol=1e-6)
    shifted = F.cross_entropy(out.logits[:, :-1].float()[keep[:, 1:]], labels[:, 1:][keep[:, 1:]])
    assert not torch.allclose(out.loss, shifted)


def test_all_ignored_labels_give_zero_not_nan():
    model = build_model(tiny(kind="encoder"), seed=0)
    ids = tokens()
    loss = model(ids, labels=torch.full_like(ids, -100)).loss
    assert loss.item() == 0.0
    loss.backward()  # still differentiable (zero gradients), so gradient accumulation is safe


def test_objective_weight_scales_the_per_target_terms_and_exactly_one_changes_nothing():
    """The weight multiplies the loss, z-loss and exit terms (means over the targets), not the MoE terms; a weight of
    exactly 1 gives the plain objective bit for bit."""
    loss, z, moe, exit_loss = (torch.tensor(v) for v in (2.3, 0.013, 0.07, 0.41))
    out = ModelOutput(loss=loss, logits=torch.zeros(1), z_loss=z, moe_loss=moe, exit_loss=exit_loss)
    assert torch.equal(out.objective(torch.tensor(1.0)), out.objective())
    torch.testing.assert_close(out.objective(torch.tensor(0.5)), 0.5 * (loss + z + exit_loss) + moe)


def test_bf16_logits_and_fp32_loss():
    model = build_model(tiny(norm="rmsnorm", activation="swiglu"), seed=0).to(torch.bfloat16)
    ids = tokens()
    out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


def test_sequence_length_limits():
    model = build_model(tiny(), seed=0)
    model(tokens(t=5))  # shorter sequences are fine
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(t=T + 1))


def test_vocab_size_must_be_resolved():
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(tiny(vocab_size=0))
    with pytest.raises(ValueError):
        build_model(tiny(vocab_size=0), seed=0)


# ----------------------------------------------------------------------------------------------
# Init and determinism
# ----------------------------------------------------------------------------------------------


def test_build_model_is_deterministic_and_leaves_global_rng_alone():
    cfg = tiny(position="learned", bias=True, activation="swiglu", tie_embeddings=False)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = build_model(cfg, seed=7).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)
    b = build_model(cfg, seed=7).state_dict()
    c = build_model(cfg, seed=8).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].std() > 0)
    assert torch.equal(torch.random.get_rng_state(), state)
    # RoPE tables are rebuilt, never saved.
    assert not any("rope" in k for k in build_model(tiny(position="rotary"), 0).state_dict())


def test_default_init_statistics():
    cfg = tiny(hidden_size=128, num_layers=4, bias=True, vocab_size=512, tie_embeddings=False)
    model = build_model(cfg, seed=0)
    std, res = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    blk = model.blocks[0]
    assert abs(model.embed_tokens.weight.std().item() - std) < 0.1 * std
    assert abs(model.lm_head.weight.std().item() - std) < 0.1 * std
    assert abs(blk.attn.q_proj.weight.std().item() - std) < 0.1 * std
    assert abs(blk.attn.o_proj.weight.std().item() - res) < 0.1 * res
    assert abs(blk.ffn.down_proj.weight.std().item() - res) < 0.1 * res
    assert torch.all(blk.attn.q_proj.bias == 0) and torch.all(model.lm_head.bias == 0)
    assert torch.all(blk.norm1.weight == 1) and torch.all(blk.norm1.bias == 0)


def test_deepnorm_alpha_and_init():
    cfg = tiny(hidden_size=128, num_layers=6, norm_placement="deepnorm", activation="swiglu", ffn_size=256)
    model = build_model(cfg, seed=0)
    n = cfg.num_layers
    alpha, beta = (2 * n) ** 0.25, (8 * n) ** -0.25
    blk = model.blocks[0]
    assert isinstance(blk.alpha, float) and blk.alpha == pytest.approx(alpha)

    def xavier(w, gain):
        return gain * math.sqrt(2.0 / (w.shape[0] + w.shape[1]))

    for w, gain in [
        (blk.attn.q_proj.weight, 1.0),
        (blk.attn.k_proj.weight, 1.0),
        (blk.attn.v_proj.weight, beta),
        (blk.attn.o_proj.weight, beta),
        (blk.ffn.gate_proj.weight, beta),
        (blk.ffn.up_proj.weight, beta),
        (blk.ffn.down_proj.weight, beta),
    ]:
        expected = xavier(w, gain)
        assert abs(w.std().item() - expected) < 0.1 * expected
    # Non-deepnorm placements keep alpha = 1.
    assert build_model(tiny(norm_placement="post"), 0).blocks[0].alpha == 1.0


# ----------------------------------------------------------------------------------------------
# Hugging Face Llama parity (conventions the exporter relies on)
# ----------------------------------------------------------------------------------------------


def test_matches_hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = tiny(
        kind="decoder",
        norm_placement="pre",
        norm="rmsnorm",
        position="rotary",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
        num_kv_heads=2,
        norm_eps=1e-6,
        rope_theta=500.0,
    )
    model = build_model(cfg, seed=3).eval()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=resolved_ffn_size(cfg),
        num_hidden_layers=L,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=T,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    hf_cfg._attn_implementation = "eager"  # independent of our SDPA path
    with torch.random.fork_rng(devices=[]):
        hf = transformers.LlamaForCausalLM(hf_cfg).eval()

    mapping = {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    for i in range(L):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        mapping[ours + "norm1.weight"] = theirs + "input_layernorm.weight"
        mapping[ours + "norm2.weight"] = theirs + "post_attention_layernorm.weight"
        for p in ("q", "k", "v", "o"):
            mapping[f"{ours}attn.{p}_proj.weight"] = f"{theirs}self_attn.{p}_proj.weight"
        for p in ("gate", "up", "down"):
            mapping[f"{ours}ffn.{p}_proj.weight"] = f"{theirs}mlp.{p}_proj.weight"
    ours_sd = model.state_dict()
    assert set(ours_sd) == set(mapping)
    hf_sd = {mapping[k]: v for k, v in ours_sd.items()}
    missing, unexpected = hf.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)

    ids = tokens(seed=5)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = model(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # The loss convention matches too (HF shifts inside).
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, labels=ids).loss, hf(input_ids=ids, labels=ids).loss, rtol=1e-4, atol=1e-4
        )


# ----------------------------------------------------------------------------------------------
# layer_mask and activation checkpointing
# ----------------------------------------------------------------------------------------------


def test_layer_mask_equals_model_without_that_block():
    cfg3 = tiny(num_layers=3, norm="rmsnorm", activation="swiglu")
    full = build_model(cfg3, seed=0).eval()
    # The 2-layer model is built with the same init scale so only the weights copied below matter.
    small = build_model(dataclasses.replace(cfg3, num_layers=2), seed=1).eval()
    sd = full.state_dict()
    remap = {}
    for k, v in sd.items():
        if k.startswith("blocks.1."):
            continue
        remap[k.replace("blocks.2.", "blocks.1.")] = v
    small.load_state_dict(remap)
    ids = tokens()
    with torch.no_grad():
        masked = full(ids, layer_mask=[True, False, True]).logits
        assert not torch.allclose(masked, full(ids).logits)
        torch.testing.assert_close(masked, small(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_all_false_layer_mask_is_embeddings_norm_head(position):
    model = build_model(tiny(position=position, embedding_norm=True), seed=0).eval()
    ids = tokens()
    with torch.no_grad():
        got = model(ids, layer_mask=[False] * L).logits
        x = model.embed_tokens(ids)
        if position == "learned":
            x = x + model.embed_positions.weight[:T]
        expected = model.lm_head(model.final_norm(model.embedding_norm(x)))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="layer_mask"):
        model(ids, layer_mask=[True])


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_activation_checkpointing_matches_plain(kind, mode):
    cfg = tiny(kind=kind, dropout=0.1, attention_dropout=0.1, activation="swiglu", num_kv_heads=2)
    ids = tokens()
    labels = ids if kind == "decoder" else mlm_labels(ids)
    results = []
    for ckpt in ("none", mode):
        model = build_model(cfg, seed=0).train()
        model.activation_checkpointing = ckpt
        calls = []
        for blk in model.blocks:
            blk.register_forward_pre_hook(lambda *a, calls=calls: calls.append(1))  # (recompute may stop early)
        torch.manual_seed(11)  # same dropout masks in both runs; checkpoint must replay them
        loss = model(ids, labels=labels).loss
        loss.backward()
        # Recomputation runs every block a second time during backward.
        assert len(calls) == (2 * L if ckpt != "none" else L)
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=0, atol=0, msg=n)


def test_activation_checkpointing_default_off():
    assert build_model(tiny(), 0).activation_checkpointing == "none"


def test_selective_recomputation_keeps_matmuls_and_recomputes_the_rest():
    """``selective`` re-runs no matmul or attention in the backward, ``full`` re-runs them all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pretrain.model.recompute import SAVED_OPS

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.saved = self.other = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in SAVED_OPS:
                self.saved += 1
            else:
                self.other += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for mode in ("none", "full", "selective"):
        model = build_model(tiny(activation="swiglu"), seed=0).train()
        model.activation_checkpointing = mode
        loss = model(tokens(), labels=tokens()).loss
        with Count() as c:
            loss.backward()
        counts[mode] = (c.saved, c.other)
    assert counts["selective"][0] == counts["none"][0] < counts["full"][0]  # no matmul forward is redone
    assert counts["none"][1] < counts["selective"][1]  # the elementwise work is


# -- utilities ---------------------------------------------------------------------------------


def test_resolved_ffn_size():
    assert resolved_ffn_size(tiny(hidden_size=256)) == 1024
    assert resolved_ffn_size(tiny(hidden_size=256, activation="swiglu")) == 704  # 682.7 -> 704
    # 10922.7 -> 10944 (Llama rounds to 256 instead: 11008)
    assert resolved_ffn_size(tiny(hidden_size=4096, activation="swiglu")) == 10944
    assert resolved_ffn_size(tiny(hidden_size=32, activation="swiglu")) == 128
    assert resolved_ffn_size(tiny(activation="swiglu", ffn_size=100)) == 100
    model = build_model(tiny(activation="swiglu", ffn_size=48), 0)
    assert model.blocks[0].ffn.up_proj.out_features == 48
