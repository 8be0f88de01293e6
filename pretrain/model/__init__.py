"""The Transformer model and its utilities (init, optimizer groups, parameter and FLOP counts)."""

from pretrain.model.counting import flops_per_token, num_parameters, param_groups
from pretrain.model.transformer import ModelOutput, Transformer, build_model, resolved_ffn_size

__all__ = [
    "ModelOutput",
    "Transformer",
    "build_model",
    "flops_per_token",
    "num_parameters",
    "param_groups",
    "resolved_ffn_size",
]
