"""The one typed config tree: dataclasses loaded strictly from YAML plus dotted overrides.

Every component receives only its own sub-config (``cfg.model``, ``cfg.data``...). Unknown keys
and wrong types raise :class:`ConfigError` naming the full key path; cross-field rules live in
:meth:`RunConfig.validate`. The resolved config round-trips through :func:`to_dict`/:func:`from_dict`
and is saved in every checkpoint. ``tree.py``: the dataclasses; ``loading.py``: strict loading.
"""

from pretrain.config.capabilities import EarlyExitConfig, GrowthStep
from pretrain.config.data import DataConfig, SourceConfig
from pretrain.config.evaluation import BUILTIN_TASK, EvalConfig
from pretrain.config.loading import (
    DEFAULT_CONFIG,
    config_hash,
    dump_yaml,
    flatten,
    from_dict,
    load_config,
    parse_override,
    split_args,
    to_dict,
)
from pretrain.config.names import source_name
from pretrain.config.plan import RunPlan, layout
from pretrain.config.train import TrainConfig
from pretrain.config.tree import (
    CheckpointConfig,
    ClusterConfig,
    ConfigError,
    FaultsConfig,
    GrowthConfig,
    LayerDropConfig,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RunConfig,
    StabilityConfig,
    TrackingConfig,
    ZeroConfig,
    make_plan,
)

__all__ = [
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EarlyExitConfig",
    "FaultsConfig",
    "GrowthConfig",
    "GrowthStep",
    "LayerDropConfig",
    "ModelConfig",
    "MoEConfig",
    "ParallelConfig",
    "RunConfig",
    "SourceConfig",
    "StabilityConfig",
    "TrackingConfig",
    "TrainConfig",
    "ZeroConfig",
    "RunPlan",
    "layout",
    "source_name",
    "EvalConfig",
    "BUILTIN_TASK",
    "make_plan",
    "config_hash",
    "dump_yaml",
    "flatten",
    "from_dict",
    "load_config",
    "parse_override",
    "to_dict",
]
