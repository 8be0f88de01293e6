"""The one package that touches DeepSpeed's private attributes and undocumented internals.

Everything else uses DeepSpeed's documented API only (``deepspeed.initialize``, the engine's public methods,
``deepspeed.zero.GatheredParameters``, the ``deepspeed.utils.safe_*`` accessors, ``zero_to_fp32``,
``deepspeed.moe.layer.MoE``); ``tests/unit/house/test_ds_adapter.py`` fails when another module reads a DeepSpeed
internal. A DeepSpeed upgrade is checked here: each function says which behaviour it relies on. Written and tested
against DeepSpeed 0.19.8 (``requirements.lock``); "0.19" below means that version.

It knows nothing of our packages (engines, optimizers and parameters come in as plain objects), so every layer that
holds DeepSpeed objects can use it: it sits in the lowest tier of ``.importlinter`` beside ``pretrain.model`` and
``pretrain.data``, and ``pretrain.model`` may not import it (its DeepSpeed imports are forbidden there).

One module per concern: ``engine.py`` (its import, communication backend, device, accelerator, universal loading),
``zero.py`` (ZeRO partitions of parameters and gradients, the optimizer wrappers), ``checkpoint.py`` (DeepSpeed's
checkpoint files, saving and loading them), ``parallel.py`` (expert-parallel groups, AutoTP, Ulysses). Callers
import the names below from ``pretrain.ds_adapter``.
"""

from pretrain.ds_adapter.checkpoint import (
    CHECKPOINT_GLOBALS,
    Save,
    checkpoint_safe_globals,
    checkpoint_state_stays_live,
    convert_to_universal,
    expert_state_files,
    load_module_state,
    module_state_files,
    rank_of_state_file,
    routing_checkpoint_files,
    saves_into_files,
    use_weights_only_loading,
    weights_only_loads,
    without_zip_crc,
    zero_optimizer_files,
    zero_partitions,
)
from pretrain.ds_adapter.engine import (
    MUON_MODULE,
    SHM_COMM_OP,
    engine_args,
    import_compiling_on_first_call,
    import_deepspeed,
    loaded_accelerator,
    set_universal_load,
    skip_shm_comm_op,
)
from pretrain.ds_adapter.parallel import (
    deepspeed_moe_subclass,
    distributed_attention,
    drop_tensor_parallel_input_check,
    expert_data_parallel_rank,
    expert_group_name,
    expert_parallel_group,
    is_expert_param,
    reset_parallel_groups,
    tag_expert_layer,
    tensor_parallel_group,
    tensor_parallel_size,
    tensor_parallel_split,
    time_model_parallel_collectives,
)
from pretrain.ds_adapter.zero import (
    Views,
    base_optimizer,
    full_optimizer_state,
    full_shape,
    grad_views,
    hp_states_linked,
    is_partitioned,
    load_partitioned_optimizer_state,
    local_param_views,
    relink_hp_optimizer_states,
    set_full_optimizer_state,
    unfused_fp32_masters,
    unlink_hp_optimizer_states,
    zero3_grad_partitions,
)

__all__ = [
    "SHM_COMM_OP",
    "skip_shm_comm_op",
    "engine_args",
    "import_deepspeed",
    "import_compiling_on_first_call",
    "MUON_MODULE",
    "loaded_accelerator",
    "set_universal_load",
    "Views",
    "is_partitioned",
    "full_shape",
    "local_param_views",
    "grad_views",
    "zero3_grad_partitions",
    "base_optimizer",
    "unfused_fp32_masters",
    "hp_states_linked",
    "unlink_hp_optimizer_states",
    "relink_hp_optimizer_states",
    "full_optimizer_state",
    "set_full_optimizer_state",
    "load_partitioned_optimizer_state",
    "CHECKPOINT_GLOBALS",
    "checkpoint_safe_globals",
    "rank_of_state_file",
    "without_zip_crc",
    "Save",
    "saves_into_files",
    "checkpoint_state_stays_live",
    "routing_checkpoint_files",
    "use_weights_only_loading",
    "weights_only_loads",
    "module_state_files",
    "expert_state_files",
    "load_module_state",
    "zero_optimizer_files",
    "zero_partitions",
    "convert_to_universal",
    "expert_group_name",
    "is_expert_param",
    "tag_expert_layer",
    "expert_data_parallel_rank",
    "expert_parallel_group",
    "deepspeed_moe_subclass",
    "tensor_parallel_group",
    "tensor_parallel_size",
    "distributed_attention",
    "time_model_parallel_collectives",
    "reset_parallel_groups",
    "tensor_parallel_split",
    "drop_tensor_parallel_input_check",
]
