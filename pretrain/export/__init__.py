"""Hugging Face export/import: exact standard classes (Llama, GPT-2, BERT) or a self-contained
``trust_remote_code`` model, always verified by a logits parity check. See :mod:`pretrain.export.hf`."""

from pretrain.export.hf import (
    ExportError,
    export_checkpoint,
    export_model,
    export_target,
    import_hf,
    model_config_from_hf,
    resolve_checkpoint,
)

__all__ = [
    "ExportError",
    "export_checkpoint",
    "export_model",
    "export_target",
    "import_hf",
    "model_config_from_hf",
    "resolve_checkpoint",
]
