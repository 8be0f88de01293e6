"""Hugging Face export and import of our Transformers, with a logits parity check (:mod:`pretrain.export.parity`).

Export (``./launch.sh export RUN_ID_OR_CHECKPOINT --out DIR [--step N] [--register NAME]``):

1. resolve the committed checkpoint (a checkpoint dir, a run dir -> latest, or an MLflow run id),
2. consolidate the DeepSpeed state (ZeRO 0/1/2/3, any number of workers) into one fp32 state dict,
3. map it to the exact standard class of :mod:`pretrain.export.families` (Llama, GPT-2, BERT) or,
   when none is exact, to the self-contained ``trust_remote_code`` model in ``remote_code/``,
4. write ``config.json``, (sharded) safetensors, the tokenizer, ``generation_config.json`` (decoders)
   and ``pretrain_export.json`` (provenance + the data config, used by ``eval``) into a staging dir,
5. load it back with ``AutoModelFor{CausalLM,MaskedLM}``/``AutoTokenizer`` and fail unless our model and
   the loaded one agree: logits within 1e-4 (fp32) on a random batch, identical token ids on probe
   texts. Only then its files are moved into ``--out`` (:mod:`pretrain.export.output`: a new or empty
   directory, or an earlier export whose own files, listed in its manifest, are replaced; no other file
   in ``--out`` is touched, and what it refuses instead is listed there).
6. An export of a tracked run is a logged model of that run; ``--register NAME`` adds a new version in the
   MLflow Model Registry. Both record the exported directory by path (no weights go through MLflow), so
   the directory's manifest lists them and a later export does not put other weights there.

Import (:mod:`pretrain.export.hf_import`): :func:`import_hf` turns an HF directory of a supported family back into our
config fields and state dict (export -> import -> export is bitwise lossless).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from pretrain.config import ConfigError, ModelConfig, MoEConfig, to_dict
from pretrain.config.errors import ArgumentParser, without_passwords
from pretrain.export.checkpoints import resolve_checkpoint, strip_module_prefix
from pretrain.export.families import StateDict, find_family
from pretrain.export.hf_import import import_hf, model_config_from_hf, read_hf_state_dict  # noqa: F401 (import_hf, model_config_from_hf, read_hf_state_dict: re-exported)
from pretrain.export.moe import moe_target, remote_moe_fields, to_hf_moe
from pretrain.export.output import check_out, commit, staging_dir
from pretrain.export.parity import (
    PARITY_TOLERANCE,
    PROBE_TEXTS,
    ExportError,
    check_device,
    check_tokenizer,
    our_model,
    parity_batch,
    parity_on,
)
from pretrain.export.registry import mlflow_references, record_export, register_model  # noqa: F401 (register_model: re-exported)
from pretrain.export.remote import REMOTE_CLASSES, REMOTE_CODE_DIR, REMOTE_MODULE, is_our_remote_code, remote_auto_map
from pretrain.model.transformer import resolved_ffn_size

METADATA_FILE = "pretrain_export.json"

# ----------------------------------------------------------------------------------------------
# Which class
# ----------------------------------------------------------------------------------------------


def unexportable(model_cfg: ModelConfig, moe: MoEConfig | None = None) -> list[str]:
    """Options that neither a standard class nor the bundled modeling file represents yet."""
    out = []
    if model_cfg.qk_norm and not (moe is not None and moe.enabled and moe_target(model_cfg, moe)[0]):
        out.append("model.qk_norm")  # only Qwen3-MoE (an MoE decoder) represents it so far
    if model_cfg.embedding_scale != 1.0:
        out.append("model.embedding_scale")
    return out


def export_target(model_cfg: ModelConfig, moe: MoEConfig | None = None) -> tuple[str | None, str]:
    """(standard HF class name, why) or (None, why not + what export does instead).

    ``train`` can call this at start to warn when a config has no exact standard equivalent.
    """
    missing = unexportable(model_cfg, moe)
    if missing:
        return None, (
            f"cannot export: {', '.join(missing)} is not represented by any supported Hugging Face "
            f"class or by the bundled modeling file; export refuses such checkpoints"
        )
    if moe is not None and moe.enabled:
        target, why = moe_target(model_cfg, moe)
        if target is not None:
            return target, f"exact standard class {target} (MoE, dropless top-k routing)"
        cls = REMOTE_CLASSES[model_cfg.kind]
        return None, (
            f"no exact standard Hugging Face MoE class ({' | '.join(why)}); export writes a "
            f"self-contained modeling file ({cls}, load with trust_remote_code=True)"
        )
    family, reasons = find_family(model_cfg)
    if family is not None:
        notes = []
        if model_cfg.norm_placement == "deepnorm":
            notes.append("DeepNorm residual scale folded exactly")
        if (model_cfg.num_kv_heads or model_cfg.num_heads) != model_cfg.num_heads and family.name != "llama":
            notes.append("grouped K/V heads repeated to multi-head (exact)")
        if not model_cfg.bias and family.name in ("gpt2", "bert"):
            notes.append("biases exported as zeros")
        extra = f" ({', '.join(notes)})" if notes else ""
        return family.hf_class, f"exact standard class {family.hf_class}{extra}"
    cls = REMOTE_CLASSES[model_cfg.kind]
    why_not = "; ".join(reasons) if reasons else f"no standard {model_cfg.kind} family is exact"
    return None, (
        f"no exact standard Hugging Face class ({why_not}); export writes a self-contained modeling file "
        f"({cls}, load with trust_remote_code=True)"
    )


def special_token_ids(tokenizer, kind: str) -> dict[str, int | None]:
    """The special token ids the exported config and generation config carry. A decoder's end of sequence is the
    document separator it was trained with (eos, or sep for a BERT-like tokenizer: ``separator_id``), so that
    ``generate`` stops where a document ended in training."""
    eos = tokenizer.eos_token_id
    if eos is None and kind == "decoder":
        eos = getattr(tokenizer, "sep_token_id", None)
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "pad_token_id": tokenizer.pad_token_id}


def remote_config_fields(model_cfg: ModelConfig, moe: MoEConfig | None = None) -> dict[str, Any]:
    """Our config as fields of the remote-code config class (``ffn_size`` resolved, MoE fields added)."""
    d = to_dict(model_cfg)
    for k in ("vocab_multiple", "init_from_hf"):
        d.pop(k)
    d["ffn_size"] = resolved_ffn_size(model_cfg)
    return {**d, **remote_moe_fields(model_cfg, moe or MoEConfig())}


def _remote_module():
    from pretrain.export.remote_code import modeling_pretrain

    return modeling_pretrain


def to_hf_model(model_cfg: ModelConfig, sd: StateDict, special: dict[str, int | None], moe: MoEConfig | None = None):
    """An in-memory HF model (standard class or our remote-code class) holding exactly ``sd``; ExportError (one line)
    for a config that no class represents (:func:`unexportable`)."""
    import transformers
    from transformers.initialization import no_init_weights

    if unexportable(model_cfg, moe):
        raise ExportError(export_target(model_cfg, moe)[1])
    sd = strip_module_prefix(sd)
    moe = moe or MoEConfig()
    family, _ = find_family(model_cfg) if not moe.enabled else (None, [])
    if moe.enabled and moe_target(model_cfg, moe)[0] is not None:
        name, cfg_kwargs, hf_sd = to_hf_moe(sd, model_cfg, moe, special)
        cls = getattr(transformers, name)
        config = cls.config_class(**cfg_kwargs)
    elif family is not None:
        cfg_kwargs, hf_sd = family.to_hf(sd, model_cfg, special)
        cls = getattr(transformers, family.hf_class)
        config = cls.config_class(**cfg_kwargs)
    else:
        mod = _remote_module()
        config = mod.PretrainTransformerConfig(**remote_config_fields(model_cfg, moe), **special)
        config.auto_map = remote_auto_map(model_cfg.kind)
        cls = getattr(mod, REMOTE_CLASSES[model_cfg.kind])
        # the bundled modeling file (byte for byte as exports hold it) names the selection bias gate.expert_bias
        hf_sd = {k.replace(".gate.selection_bias", ".gate.expert_bias"): v for k, v in sd.items()}
    config.architectures = [cls.__name__]
    with no_init_weights():  # every weight is overwritten below
        model = cls(config)
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    tied = set(model.all_tied_weights_keys) if hasattr(model, "all_tied_weights_keys") else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ExportError(f"{cls.__name__}: weights missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    if model_cfg.kind == "decoder":
        from transformers import GenerationConfig

        eos = special.get("eos_token_id")
        model.generation_config = GenerationConfig(
            bos_token_id=special.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=special.get("pad_token_id") if special.get("pad_token_id") is not None else eos,
            do_sample=False,
            use_cache=not isinstance(model, _remote_module().PretrainTransformerPreTrainedModel),
        )
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Writing and verifying an export directory
# ----------------------------------------------------------------------------------------------


@dataclass
class ExportReport:
    out: Path
    hf_class: str
    standard: bool
    reason: str
    max_abs_diff: float
    shards: int
    tokenizer_checks: int
    registered_version: int | None = None


def load_exported(path: Path, kind: str, ours: bool = True):
    """``AutoModelFor{CausalLM,MaskedLM}`` from an export dir (fp32); ExportError on incomplete loading. ``ours``:
    the directory is an export of this project, which holds exactly the class's weights; another directory may
    hold weights the class does not use (a hub BERT's pooler and next-sentence head), which load as ``transformers``
    loads them: only missing or mismatched weights are refused."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    auto = AutoModelForCausalLM if kind == "decoder" else AutoModelForMaskedLM
    remote = is_our_remote_code(path)
    # output_loading_info=True: (model, info), which the stubs do not express
    model, info = cast(
        tuple[Any, dict[str, Any]],
        auto.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=remote, output_loading_info=True),
    )
    checked = ("missing_keys", "unexpected_keys", "mismatched_keys") if ours else ("missing_keys", "mismatched_keys")
    problems = {k: v for k, v in info.items() if v and k in checked}
    if problems:
        raise ExportError(f"{path}: loading was incomplete: {problems}")
    return model.eval()


def _set_model_max_length(export_dir: Path, max_seq_len: int) -> None:
    """The exported tokenizer's ``model_max_length`` is the model's context (``transformers`` truncates to it and
    warns past it; the tokenizer alone does not know it), written into its ``tokenizer_config.json``."""
    path = export_dir / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**config, "model_max_length": max_seq_len}, indent=2, ensure_ascii=False) + "\n")


def export_model(
    model_cfg: ModelConfig,
    sd: StateDict,
    tokenizer,
    out: Path,
    *,
    max_shard_size: str | int = "2GB",
    metadata: dict | None = None,
    probe_texts: list[str] | None = None,
    log=print,
    moe: MoEConfig | None = None,
    referenced_by: list[dict[str, Any]] | None = None,
    device: str = "cpu",
) -> ExportReport:
    """Write an HF directory for (``model_cfg``, ``moe``, ``sd``) with ``tokenizer`` and verify it (module doc).

    ``referenced_by``: the MLflow records that will name the directory (kept in its manifest). ``device``: where
    the parity check runs both models (fp32; TF32 matmuls off for it on CUDA).
    """
    from transformers import AutoTokenizer

    hf_class, reason = export_target(model_cfg, moe)
    if unexportable(model_cfg, moe):
        raise ExportError(reason)  # refused up front, never approximated
    standard = hf_class is not None
    special = special_token_ids(tokenizer, model_cfg.kind)
    hf_model = to_hf_model(model_cfg, sd, special, moe)
    stage = staging_dir(out)
    try:
        hf_model.save_pretrained(str(stage), max_shard_size=max_shard_size)
        if not standard:
            shutil.copy2(REMOTE_CODE_DIR / f"{REMOTE_MODULE}.py", stage / f"{REMOTE_MODULE}.py")
        tokenizer.save_pretrained(str(stage))
        _set_model_max_length(stage, model_cfg.max_seq_len)
        del hf_model

        loaded = load_exported(stage, model_cfg.kind)
        ours = our_model(model_cfg, sd, moe)
        diff = parity_on(device, ours, loaded, parity_batch(model_cfg))
        del ours, loaded
        log(f"[export] parity: max |logits diff| = {diff:.3e} (fp32 on {device}, tolerance {PARITY_TOLERANCE:.0e})")
        if not diff <= PARITY_TOLERANCE:  # also catches NaN
            raise ExportError(f"parity failed: max |logits diff| {diff:.3e} > {PARITY_TOLERANCE:.0e}")
        # AutoTokenizer reads config.json first: our own remote-code config needs the same trust.
        exported_tok = AutoTokenizer.from_pretrained(str(stage), trust_remote_code=not standard)
        checks = check_tokenizer(tokenizer, exported_tok, PROBE_TEXTS + list(probe_texts or []))
        shards = len(list(stage.glob("*.safetensors")))
        meta = {
            "format": 1,
            "hf_class": hf_class or REMOTE_CLASSES[model_cfg.kind],
            "standard_class": standard,
            "trust_remote_code": not standard,
            "reason": reason,
            "kind": model_cfg.kind,
            "parity_max_abs_diff": diff,
            "model_config": to_dict(model_cfg),
            **({"moe_config": to_dict(moe)} if moe is not None and moe.enabled else {}),
            **(metadata or {}),
        }
        (stage / METADATA_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        out = commit(stage, out, referenced_by=referenced_by)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return ExportReport(
        out=out,
        hf_class=meta["hf_class"],
        standard=standard,
        reason=reason,
        max_abs_diff=diff,
        shards=shards,
        tokenizer_checks=checks,
    )


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def export_checkpoint(
    source: str,
    out: str | Path,
    *,
    step: int | None = None,
    register: str | None = None,
    max_shard_size: str | int = "2GB",
    log=print,
    device: str = "cpu",
) -> ExportReport:
    """Export a committed checkpoint (path or run id) to ``out``; optionally register it. ``device``: where the
    parity check runs."""
    check_out(Path(out))  # refuse before consolidating the checkpoint (commit checks again)
    loaded = resolve_checkpoint(source, step)
    cfg, ckpt = loaded.config, loaded.ckpt
    world = ckpt.manifest.world_size
    log(f"[export] {ckpt.path} (step {ckpt.step}, ZeRO-{cfg.zero.stage}, {world} worker(s))")
    hf_class, reason = export_target(cfg.model, cfg.moe)
    log(f"[export] target: {reason}")
    sd = loaded.state_dict()
    tokenizer = loaded.tokenizer()
    meta = {
        "source": {
            "checkpoint": str(ckpt.path),
            "step": ckpt.step,
            "run_id": loaded.run_id or ckpt.manifest.run_id or None,
        },
        "data": json.loads(without_passwords(json.dumps(to_dict(cfg.data)))),  # an export is made to be shared
        "seed": cfg.train.seed,
        "val_sequences": cfg.train.val_sequences,
        "max_seq_len": cfg.model.max_seq_len,
        "eval": {"max_examples": cfg.eval.max_examples, "num_choices": cfg.eval.num_choices},  # how it scored tasks
    }
    refs = mlflow_references(loaded.run_id, register)
    report = export_model(
        cfg.model,
        sd,
        tokenizer,
        Path(out),
        max_shard_size=max_shard_size,
        metadata=meta,
        log=log,
        moe=cfg.moe,
        referenced_by=refs,
        device=device,
    )
    log(f"[export] tokenizer: {report.tokenizer_checks} probe texts encode to the training ids")
    log(
        f"[export] wrote {report.out} ({report.hf_class}, {report.shards} safetensors shard(s)"
        f"{', trust_remote_code=True' if not report.standard else ''})"
    )
    # loaded.run_id: a run of the tracking store (resolve_checkpoint checked)
    report.registered_version = record_export(
        report.out,
        run_id=loaded.run_id,
        register=register,
        step=ckpt.step,
        checkpoint=ckpt.path,
        hf_class=report.hf_class,
        log=log,
    )
    return report


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh export", description="Export a checkpoint as a Hugging Face model directory.")
    p.add_argument("source", help="MLflow run id, run directory (latest checkpoint) or checkpoint directory")
    p.add_argument("--out", required=True, help="output directory: new, empty, or an earlier export (its files)")
    p.add_argument("--step", type=int, default=None, help="export this committed step instead of the latest")
    p.add_argument("--register", default=None, metavar="NAME", help="register in the MLflow Model Registry")
    p.add_argument("--max-shard-size", default="2GB", help="safetensors shard size (default 2GB)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where the logits parity check runs both models in fp32: cpu (default), cuda or cuda:N",
    )
    a = p.parse_args(argv)
    check_device("export", a.device)
    export_checkpoint(
        a.source, a.out, step=a.step, register=a.register, max_shard_size=shard_size(a.max_shard_size), device=a.device
    )
    return 0


def shard_size(text: str) -> int:
    """``--max-shard-size`` in bytes: a number of bytes, or a number with KB, MB, GB or TB (powers of 10, as
    ``transformers``' ``save_pretrained`` reads them) or KiB, MiB, GiB or TiB (powers of 2); ConfigError for anything
    else, before any work."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(I?)B)?\s*", text, re.IGNORECASE)
    power = "KMGT".index(m[2].upper()) + 1 if m and m[2] else 0
    size = int(float(m[1]) * (1024 if m[3] else 1000) ** power) if m else 0
    if size <= 0:
        raise ConfigError(
            f"export --max-shard-size: {text!r}: expected bytes (> 0), or a number with KB, MB, GB, TB (or KiB, ...)"
        )
    return size
