"""The DeepSpeed config and optimizer the engine is built from (``pretrain/train/engine.py``): what it asks of
DeepSpeed for the optimizer offload and for bf16 gradients. The runs themselves are in
tests/integration/parallel/test_zero.py (offload) and tests/integration/train/test_memory_plan.py (bf16)."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import make_plan
from pretrain.train.engine import build_optimizer, deepspeed_config
from tests.harness import tiny_config


def _ds(precision: str, *overrides: str) -> dict:
    cfg = tiny_config("cluster.num_workers=2", *overrides)
    return deepspeed_config(cfg, make_plan(cfg, 2), precision)


def test_offload_takes_the_client_adamw_fused_on_the_host():
    """DeepSpeed refuses a client optimizer under offload unless ``zero_force_ds_cpu_optimizer`` is false; ours is
    torch's fused AdamW there (a vectorized host kernel), the default implementation everywhere else."""
    ds = _ds("fp32", "zero.stage=2", "zero.offload_optimizer=true")
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_force_ds_cpu_optimizer"] is False
    for stage, offloaded in ((0, False), (1, False), (3, True)):
        ds = _ds("fp32", f"zero.stage={stage}", f"zero.offload_optimizer={str(offloaded).lower()}")
        assert ("zero_force_ds_cpu_optimizer" in ds) is offloaded
    plain_dp = tiny_config("cluster.num_workers=2", "zero.stage=0")
    plain_dp.zero.offload_optimizer = True  # refused by the config's checks; the engine ignores it at stage 0 too
    assert "offload_optimizer" not in deepspeed_config(plain_dp, make_plan(plain_dp, 2), "fp32")["zero_optimization"]

    params = [{"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": 0.0}]
    fused = build_optimizer(params, tiny_config("zero.stage=1", "zero.offload_optimizer=true"))
    plain = build_optimizer(params, tiny_config("zero.stage=1"))
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    assert plain.defaults["fused"] is None and plain.defaults["foreach"] is None  # torch's choice per device


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_are_summed_and_reduced_in_fp32(stage):
    """bf16: micro-batches add into fp32 gradients (from ZeRO-1; DeepSpeed 0.19 refuses it at ZeRO-0) and the
    reduction runs in fp32; fp32 runs leave DeepSpeed's defaults (fp32 already)."""
    ds = _ds("bf16", f"zero.stage={stage}")
    assert ds["bf16"] == {"enabled": True}
    assert ds["communication_data_type"] == "fp32"
    assert ds.get("data_types") == (None if stage == 0 else {"grad_accum_dtype": "fp32"})
    fp32 = _ds("fp32", f"zero.stage={stage}")
    assert "communication_data_type" not in fp32 and "data_types" not in fp32


def test_the_engine_stays_on_the_workers_gpu():
    """DeepSpeed would select LOCAL_RANK's GPU; the args name the worker's own (its index among the visible ones)."""
    from pretrain.ds_adapter import engine_args

    assert engine_args(torch.device("cuda", 3)).device_rank == 3
    assert engine_args(torch.device("cpu")) is None


def test_tensor_parallelism_is_refused_where_autotp_would_select_another_gpu(monkeypatch):
    """AutoTP selects ``LOCAL_RANK``'s GPU while it partitions: a worker that sees only its own GPU (local rank 1 on
    cuda:0) is refused in one line; the same GPU, no tensor parallelism or the CPU pass."""
    from pretrain.config import ConfigError
    from pretrain.train.engine import check_tensor_parallel_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match=r"^parallel.tensor=2: DeepSpeed's tensor parallelism would select GPU 1 "):
        check_tensor_parallel_device(2, torch.device("cuda", 0))
    check_tensor_parallel_device(2, torch.device("cuda", 1))
    check_tensor_parallel_device(1, torch.device("cuda", 0))
    check_tensor_parallel_device(2, torch.device("cpu"))


def test_auto_precision_is_bf16_only_where_the_gpu_computes_in_it(monkeypatch):
    """A GPU whose bf16 torch only emulates (before Ampere: T4, V100) trains fp32 under ``auto``; a CPU run too."""
    import torch

    from pretrain.train.engine import resolve_precision

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_precision("auto", gpu) == "fp32" and resolve_precision("bf16", gpu) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("auto", gpu) == "bf16" and resolve_precision("auto", torch.device("cpu")) == "fp32"
