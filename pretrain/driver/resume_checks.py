"""What a resume may change, checked on the driver before anything starts or is recorded: each refusal is one
line (:class:`ConfigError`, exit 2) that says what can change instead, and the run it would have resumed keeps
its MLflow status.

* the architecture (parameter shapes) cannot change: ``grow`` and ``prune`` make a new run of another shape;
* ZeRO-1 and ZeRO-2 checkpoints load into each other; DeepSpeed loads a ZeRO-3 checkpoint only into ZeRO-3 (a
  checkpoint of full weights, as ``grow`` and ``prune`` write, into any stage);
* the LR cannot jump up across the resume: a changed schedule may not give the next step a higher LR than the
  last step trained had and the checkpoint's schedule gives it (:func:`pretrain.train.schedule.extension_refusal`);
* the data must be what the checkpoint trained on (:func:`pretrain.data.fingerprint.check_unchanged`), read in the
  same order: ``data.shuffle_sequences`` cannot change (the data state holds a buffer of that size), nor what
  defines the streams (their number, the holdout, the pieces, the sources but their paths, the sequence length).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pretrain.config import ConfigError, RunConfig
from pretrain.config.errors import quote
from pretrain.invocation import command
from pretrain.train.schedule import decayed_out, extension_refusal, train_longer

SHAPE_FIELDS = (
    "kind",
    "vocab_size",
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "ffn_size",
    "activation",
    "norm",
    "norm_placement",
    "position",
    "tie_embeddings",
    "bias",
    "lm_head_bias",
    "embedding_norm",
    "final_norm",
    "mlm_head_transform",
    "qk_norm",
)
"""``model.*`` fields that decide the parameters' names and shapes (with ``max_seq_len`` for learned positions)."""

MOE_SHAPE_FIELDS = ("num_experts", "every", "layers", "ffn_size")


def check_steps_left(saved: RunConfig, cfg: RunConfig, step: int, checkpoint: str) -> None:
    """Refuse a resume with no step left to train (it would end at once and report a finished run of 0 tokens/s)."""
    if cfg.train.max_steps <= step:
        why = decayed_out(saved.train, step)
        raise ConfigError(
            f"train.max_steps is {cfg.train.max_steps} and {checkpoint} is at step {step}: there is nothing to "
            + (f"train, and {why}" if why else f"train. To train on: {train_longer(saved.train, step)}")
        )


def check_resume(saved: RunConfig, cfg: RunConfig, step: int, checkpoint: str, engine_state: bool = True) -> None:
    """Refuse, in one line, a resume of ``checkpoint`` (saved with ``saved``, at ``step``) as ``cfg``;
    ``engine_state``: the checkpoint holds DeepSpeed engine state (its ZeRO stage matters), not full weights."""
    changed = _shape_change(saved, cfg)
    if changed:
        key, old, new = changed
        raise ConfigError(
            f"{key} cannot change at resume (checkpoint {quote(old)}, asked {quote(new)}): the checkpoint's weights "
            f"have other shapes. A bigger or smaller model of this one is a new run: {command()} grow {checkpoint} "
            f"depth=2x (or {command()} prune {checkpoint} layers=every_other; docs/growth.md); otherwise resume with "
            f"{key}={_yaml(old)}"
        )
    if saved.moe.selection_bias != cfg.moe.selection_bias:
        old_b, new_b = saved.moe.balance, cfg.moe.balance
        raise ConfigError(
            f"moe.balance cannot change from {old_b} to {new_b} at resume: "
            + (
                "the checkpoint has no selection bias to load"
                if new_b != "aux_loss"
                else "the checkpoint's selection biases would be dropped"
            )
            + f"; resume with moe.balance={old_b}"
            + (" (or both)" if old_b == "bias" else " (or bias)" if old_b == "both" else "")
        )
    old_stage, new_stage = saved.zero.stage, cfg.zero.stage
    if engine_state and old_stage != new_stage and {old_stage, new_stage} != {1, 2}:
        raise ConfigError(
            f"zero.stage cannot change from {old_stage} to {new_stage} at resume: DeepSpeed loads ZeRO-1 and ZeRO-2 "
            "checkpoints into each other; a ZeRO-0 or ZeRO-3 one only into its own stage. Resume with "
            f"zero.stage={old_stage}, or export the weights ({command()} export) and start a run from them "
            "(model.init_from_hf)"
        )
    old_k, new_k = saved.data.shuffle_sequences, cfg.data.shuffle_sequences
    if old_k != new_k:
        raise ConfigError(
            f"data.shuffle_sequences cannot change at resume (checkpoint {old_k}, asked {new_k}): the checkpoint's "
            f"data position is a shuffle buffer of {old_k} sequences per stream. Resume with "
            f"data.shuffle_sequences={old_k}, or start a new run from its weights ({command()} export, then "
            "model.init_from_hf)"
        )
    stream = _stream_change(saved, cfg)
    if stream:
        key, old, new = stream
        keep = f"{key}={_yaml(old)}" if not key.endswith("sources") else f"the checkpoint's {key}"
        raise ConfigError(
            f"{key} cannot change at resume (checkpoint {quote(old)}, asked {quote(new)}): the checkpoint's data "
            f"position is a position in the streams it defines (also with data.allow_changed). Resume with "
            f"{keep}, or start a new run from its weights ({command()} export, then model.init_from_hf)"
        )
    refusal = extension_refusal(saved.train, cfg.train, step)
    if refusal:
        raise ConfigError(refusal)


def _shape_value(cfg: RunConfig, name: str) -> Any:
    """``model.<name>`` as it shapes the parameters (``lm_head_bias``: resolved, null following ``bias``)."""
    return cfg.model.output_bias if name == "lm_head_bias" else getattr(cfg.model, name)


def _shape_change(saved: RunConfig, cfg: RunConfig) -> tuple[str, Any, Any] | None:
    fields = list(SHAPE_FIELDS)
    if saved.model.position == "learned":
        fields.append("max_seq_len")
    for name in fields:
        old, new = _shape_value(saved, name), _shape_value(cfg, name)
        if old != new:
            return f"model.{name}", old, new
    for name in MOE_SHAPE_FIELDS:
        old, new = getattr(saved.moe, name), getattr(cfg.moe, name)
        if old != new:
            return f"moe.{name}", old, new
    return None


STREAM_FIELDS = ("num_streams", "val_holdout", "piece_chars")
"""``data.*`` fields that define the streams a data position is a position in (with the sources' count and their
fields but the path: a moved file is the fingerprint's to judge, ``data.allow_changed``)."""


def _stream_change(saved: RunConfig, cfg: RunConfig) -> tuple[str, Any, Any] | None:
    if saved.model.max_seq_len != cfg.model.max_seq_len:  # the position holds packed sequences of that length
        return "model.max_seq_len", saved.model.max_seq_len, cfg.model.max_seq_len
    for name in STREAM_FIELDS:
        old, new = getattr(saved.data, name), getattr(cfg.data, name)
        if old != new:
            return f"data.{name}", old, new
    for group in ("sources", "val_sources"):
        old_list, new_list = getattr(saved.data, group), getattr(cfg.data, group)
        if len(old_list) != len(new_list):
            return f"data.{group}", f"{len(old_list)} source(s)", f"{len(new_list)} source(s)"
        for i, (a, b) in enumerate(zip(old_list, new_list)):
            for f in dataclasses.fields(a):
                if f.name != "path" and getattr(a, f.name) != getattr(b, f.name):
                    return f"data.{group}[{i}].{f.name}", getattr(a, f.name), getattr(b, f.name)
    return None


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return quote(value) if not isinstance(value, str) else value
