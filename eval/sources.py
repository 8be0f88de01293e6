"""What ``eval`` evaluates (:class:`EvalSource`): a checkpoint (run id, run dir, checkpoint dir) or a Hugging Face
directory, with the defaults of the run that made it (its data config, sequence length, seed, validation size, how it
scored its tasks)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.config import ConfigError, DataConfig, SourceConfig, load_config


@dataclass
class EvalSource:
    """What is evaluated and on which data (defaults from the run that produced it)."""

    label: str
    kind: str
    tokenizer: Any
    logits_fn: Callable[[torch.Tensor], torch.Tensor]
    hf_model: Callable[[], Any]
    """Lazily builds the transformers model (for generate)."""
    hf_dir: Callable[[], AbstractContextManager[Path]]
    """A Hugging Face directory of the model while the context lasts (a checkpoint's is exported into a temporary
    directory, removed at its end)."""
    data: DataConfig | None
    seq_len: int
    """The default sequence length."""
    context: int
    """The longest sequence the model takes (``--seq-len``'s bound)."""
    seed: int
    val_sequences: int
    vocab_size: int
    run_id: str | None = None
    step: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    no_hf: str = ""
    """Why the model has no ``transformers`` equivalent (no greedy sample, no harness); empty when it has one."""
    tasks: dict[str, int] = field(default_factory=lambda: {"max_examples": 200, "num_choices": 4})
    """How the run scored its tasks (``eval.max_examples``, ``eval.num_choices``): what ``--tasks`` does unless told."""


def _export_tasks(meta: dict[str, Any]) -> dict[str, int]:
    """How the run of our export scored its tasks (``pretrain_export.json``'s ``eval``; the defaults otherwise)."""
    out = {"max_examples": 200, "num_choices": 4}
    saved = meta.get("eval")
    if isinstance(saved, dict):
        out.update({k: int(saved[k]) for k in out if isinstance(saved.get(k), int)})
    return out


def open_hf_dir(path: Path) -> EvalSource:
    from eval.hf_dir import open_hf_dir as open_dir
    from eval.hf_dir import usable_positions

    hf = open_dir(path, "eval")
    config, model, meta = hf.config, hf.model, hf.meta
    data = load_config(None, base={"data": meta["data"]}).data if "data" in meta else None
    max_pos = usable_positions(config, model) or 1024
    src = meta.get("source", {})
    return EvalSource(
        label=f"HF directory {path} ({type(model).__name__})",
        kind=hf.kind,
        tokenizer=hf.tokenizer,
        logits_fn=lambda ids: model(input_ids=ids).logits,
        hf_model=lambda: model,
        hf_dir=lambda: contextlib.nullcontext(path),
        data=data,
        seq_len=int(meta.get("max_seq_len") or min(max_pos, 1024)),
        context=int(meta.get("max_seq_len") or max_pos),
        seed=int(meta.get("seed", 0)),
        val_sequences=int(meta.get("val_sequences", 64)),
        tasks=_export_tasks(meta),
        vocab_size=int(config.vocab_size),
        info={"hf_class": type(model).__name__, "exported_from": src or None},
    )


def open_checkpoint(target: str, step: int | None) -> EvalSource:
    from pretrain.export.checkpoints import resolve_checkpoint
    from pretrain.export.hf import special_token_ids, to_hf_model, unexportable
    from pretrain.export.parity import our_model

    loaded = resolve_checkpoint(target, step)
    cfg = loaded.config
    sd = loaded.state_dict()
    model = our_model(cfg.model, sd, cfg.moe)
    tokenizer = loaded.tokenizer()
    cache: dict[str, Any] = {}

    def hf_model():
        if "m" not in cache:
            cache["m"] = to_hf_model(cfg.model, sd, special_token_ids(tokenizer, cfg.model.kind), cfg.moe)
        return cache["m"]

    @contextlib.contextmanager
    def hf_dir() -> Iterator[Path]:
        import tempfile

        from pretrain.export.hf import export_model

        with tempfile.TemporaryDirectory(prefix="pretrain-eval-") as tmp:
            export_model(cfg.model, sd, tokenizer, Path(tmp) / "hf", log=lambda *a: None, moe=cfg.moe)
            yield Path(tmp) / "hf"

    return EvalSource(
        label=f"checkpoint {loaded.ckpt.path} (step {loaded.ckpt.step})",
        kind=cfg.model.kind,
        tokenizer=tokenizer,
        logits_fn=lambda ids: model(ids).logits,
        hf_model=hf_model,
        hf_dir=hf_dir,
        data=cfg.data,
        seq_len=cfg.model.max_seq_len,
        context=cfg.model.max_seq_len,
        seed=cfg.train.seed,
        val_sequences=cfg.train.val_sequences,
        vocab_size=cfg.model.vocab_size,
        run_id=loaded.run_id,
        step=loaded.ckpt.step,
        info={"checkpoint": str(loaded.ckpt.path)},
        no_hf=", ".join(unexportable(cfg.model, cfg.moe)),
        tasks={"max_examples": cfg.eval.max_examples, "num_choices": cfg.eval.num_choices},
    )


def open_source(target: str, step: int | None = None) -> EvalSource:
    from eval.hf_dir import is_hf_dir

    path = Path(target).expanduser()
    if path.is_dir() and is_hf_dir(path):
        if step is not None:
            raise ConfigError("--step applies to runs and checkpoints, not to a Hugging Face directory")
        return open_hf_dir(path.resolve())
    return open_checkpoint(target, step)


def data_config(src: EvalSource, paths: list[str]) -> DataConfig:
    """The run's data config, or one whose validation sources are ``paths``."""
    return data_config_of(src.data, src.label, paths)


def data_config_of(data: DataConfig | None, label: str, paths: list[str]) -> DataConfig:
    """``data`` (the data config of the run that made the model ``label``), or one whose validation sources are
    ``paths``; ConfigError when neither is given."""
    base = data or DataConfig()
    if not paths:
        if data is None:
            raise ConfigError(f"{label}: no data config travels with it; pass --data PATH")
        hidden = [s.path for s in [*data.sources, *data.val_sources] if ":***@" in s.path]
        if hidden:  # an export's data config, a URL's password left out (pretrain_export.json)
            raise ConfigError(
                f"{label}: its data source {hidden[0]} needs a password the export leaves out; pass --data PATH or URL"
            )
        return base
    sources = []
    for p in paths:
        local = Path(p).expanduser()
        sources.append(SourceConfig(path=str(local.resolve()) if local.exists() else p))
    return dataclasses.replace(base, val_sources=sources)
