"""The decoder that ``generate`` (and the studies' decoding) runs: the ``transformers`` model of a run, a checkpoint
or a Hugging Face directory, with its tokenizer and what bounds the arguments (depth, context), on the device and in
the dtype asked for.

A checkpoint's model is the one the export would write (:func:`pretrain.export.hf.to_hf_model`, built in memory from
the consolidated weights; nothing is written); a directory's is the one it holds. An encoder, a model with no
``transformers`` class, a missing source or a bad device is refused in one line (:class:`ConfigError`, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.config import ConfigError, load_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Generator:
    """A decoder ready to generate: the ``transformers`` model, its tokenizer and what bounds the arguments."""

    model: Any
    tokenizer: Any
    label: str
    num_layers: int
    context: int
    info: dict[str, Any] = field(default_factory=dict)
    data: Any = None
    """The data config of the run that made the model (a ``DataConfig``; None when unknown): its held-out text."""
    seed: int = 0
    """That run's seed (which documents its hash holdout keeps)."""


def _decoder_only(label: str, kind: str) -> None:
    if kind != "decoder":
        raise ConfigError(f"generate: {label} is an {kind} (masked LM); generate needs a decoder (causal LM)")


def _from_checkpoint(target: str, step: int | None) -> Generator:
    from pretrain.export.checkpoints import resolve_checkpoint
    from pretrain.export.hf import export_target, special_token_ids, to_hf_model, unexportable

    loaded = resolve_checkpoint(target, step)
    cfg = loaded.config
    label = f"checkpoint {loaded.ckpt.path} (step {loaded.ckpt.step})"
    _decoder_only(label, cfg.model.kind)
    if unexportable(cfg.model, cfg.moe):
        raise ConfigError(f"generate: {label}: {export_target(cfg.model, cfg.moe)[1]}")
    tokenizer = loaded.tokenizer()
    model = to_hf_model(cfg.model, loaded.state_dict(), special_token_ids(tokenizer, cfg.model.kind), cfg.moe)
    return Generator(
        model=model,
        tokenizer=tokenizer,
        label=label,
        num_layers=cfg.model.num_layers,
        context=cfg.model.max_seq_len,
        info={"checkpoint": str(loaded.ckpt.path), "step": loaded.ckpt.step, "run_id": loaded.run_id},
        data=cfg.data,
        seed=cfg.train.seed,
    )


def _from_hf_dir(path: Path) -> Generator:
    from eval.hf_dir import open_hf_dir

    hf = open_hf_dir(path, "generate", need="decoder")
    label = f"HF directory {path}"
    _decoder_only(label, hf.kind)
    meta = hf.meta
    text = hf.config.get_text_config()
    context = meta.get("max_seq_len") or getattr(text, "max_position_embeddings", None)
    if not context:
        raise ConfigError(f"generate: {path}/config.json: no max_position_embeddings (the model's context)")
    return Generator(
        model=hf.model,
        tokenizer=hf.tokenizer,
        label=label,
        num_layers=int(text.num_hidden_layers),
        context=int(context),
        info={"hf_dir": str(path), **({"exported_from": meta["source"]} if "source" in meta else {})},
        data=load_config(None, base={"data": meta["data"]}).data if "data" in meta else None,
        seed=int(meta.get("seed", 0)),
    )


def on_device(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` with its floating parameters in ``dtype``; its floating buffers keep their dtype (fp32:
    the RoPE frequencies, whose rounding to bf16 shifts the angles by up to radians over a long context, and the MoE
    selection biases), as ``from_pretrained(dtype=...)`` keeps them and training does."""
    model.to(device=device)
    buffers = [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]
    model.to(dtype=dtype)
    for name, kept in buffers:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, kept)
    return model


def load_generator(target: str, step: int | None = None, device: str = "cpu", dtype: str = "float32") -> Generator:
    """The decoder of ``target`` (an MLflow run id, a run or checkpoint directory, or a Hugging Face directory) on
    ``device`` in ``dtype``; ConfigError (exit 2) for a missing source, an encoder, a bad device."""
    from eval.hf_dir import is_hf_dir
    from pretrain.export.parity import check_device

    check_device("generate", device)
    path = Path(target).expanduser()
    if path.is_dir() and is_hf_dir(path):
        if step is not None:
            raise ConfigError("generate --step applies to runs and checkpoints, not to a Hugging Face directory")
        gen = _from_hf_dir(path.resolve())
    else:
        gen = _from_checkpoint(target, step)
    on_device(gen.model, torch.device(device), DTYPES[dtype]).eval()
    gen.info.update(hf_class=type(gen.model).__name__, device=device, dtype=dtype)
    return gen
