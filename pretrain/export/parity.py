"""The parity of an export: our model rebuilt from a state dict, a fixed random batch, the largest logits difference
against the exported model (on the CPU or a GPU, in fp32), and the tokenizer's ids on probe texts. An export is
written only when these agree (:func:`pretrain.export.hf.export_model`)."""

from __future__ import annotations

import re

import torch

from pretrain.config import ConfigError, ModelConfig, MoEConfig
from pretrain.export.checkpoints import strip_module_prefix
from pretrain.export.families import StateDict
from pretrain.model.transformer import Transformer, build_model

PARITY_TOLERANCE = 1e-4
"""The largest logits difference (fp32) an export may show against our model."""

# Texts whose ids must be identical under the training tokenizer and the exported one.
PROBE_TEXTS = [
    "Hello world",
    " leading space",
    "trailing space ",
    "  two  spaces\tand\ttabs\n\nnewlines\r\n",
    "<|endoftext|>",
    "a<|endoftext|>b <|pad|> <|mask|><|unk|>",
    "Ünïcödé: naïve café, 日本語, 한국어, emoji 🙂🚀",
    "numbers 1234567890 3.14159 1e-5",
    "code: def f(x):\n    return x ** 2  # comment",
    "",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "ﬁ ligature, Ⅻ, combining e\u0301",
]


class ExportError(RuntimeError):
    """The export could not be verified (parity, tokenizer fidelity, loading)."""


def our_model(model_cfg: ModelConfig, sd: StateDict, moe: MoEConfig | None = None) -> Transformer:
    """Our Transformer holding ``sd`` (built on meta, weights assigned: no wasted init); MoE layers hold every
    expert (``ep_size`` 1)."""
    return build_model(model_cfg, 0, moe, weights=strip_module_prefix(sd)).eval()


def parity_batch(model_cfg: ModelConfig, batch: int = 2, seq_len: int = 64, seed: int = 0) -> torch.Tensor:
    """A fixed random batch of token ids, (batch, min(seq_len, max_seq_len))."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model_cfg.vocab_size, (batch, min(seq_len, model_cfg.max_seq_len)), generator=g)


@torch.no_grad()
def logits_max_abs_diff(ours: Transformer, hf_model, input_ids: torch.Tensor) -> float:
    """max |our logits - HF logits| (fp32) on ``input_ids``."""
    a = ours(input_ids).logits.float()
    b = hf_model(input_ids=input_ids).logits.float()
    if a.shape != b.shape:
        raise ExportError(f"logits shapes differ: ours {tuple(a.shape)}, HF {tuple(b.shape)}")
    return float((a - b).abs().max())


def check_device(who: str, device: str) -> None:
    """ConfigError (one line, naming the command ``who``) unless ``device`` is ``cpu``, or ``cuda`` / ``cuda:N`` with
    CUDA available and N below the number of CUDA devices here."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ConfigError(f"{who} --device: {device!r} is not cpu, cuda or cuda:N")
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"{who} --device {device}: no CUDA device is available here")
    n = torch.cuda.device_count()
    if int(device.partition(":")[2] or 0) >= n:
        raise ConfigError(f"{who} --device {device}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")


def parity_on(device: str, ours: Transformer, hf_model, input_ids: torch.Tensor) -> float:
    """:func:`logits_max_abs_diff` with both models and the batch on ``device`` (fp32: TF32 matmuls are turned off
    for the check and restored after)."""
    check_device("export", device)
    dev = torch.device(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return logits_max_abs_diff(ours.to(dev), hf_model.to(dev), input_ids.to(dev))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def check_tokenizer(train_tokenizer, exported_tokenizer, texts: list[str]) -> int:
    """Raise unless both tokenizers give the ids training used (no special tokens added); returns count."""
    from pretrain.data.tokenizer import make_encoder

    want = make_encoder(train_tokenizer)(list(texts))
    got = exported_tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    for text, w, g in zip(texts, want, got):
        if list(w) != list(g):
            raise ExportError(
                f"tokenizer mismatch on {text[:60]!r}: training ids {list(w)[:12]}..., exported ids {list(g)[:12]}..."
            )
    return len(texts)
