"""The FLOP/s a device can reach, shared by ``./launch.sh bench`` and training's ``train/mfu``: MFU is model
FLOPs/s (:func:`pretrain.model.flops_per_token` x tokens/s) over this peak.

* :func:`measured_matmul_peak`: a large square matmul in the run's dtype (what the device measurably reaches);
* :func:`datasheet_peak`: NVIDIA's dense bf16 tensor-core peak of known GPUs;
* :func:`device_peak`: the one training uses — the datasheet peak on a known GPU in bf16, else the measured one,
  measured once per device model, dtype, thread count and torch version and kept in the user's cache
  (:mod:`pretrain.user_cache`; delete ``<cache root>/matmul-peak/`` to measure again).
"""

from __future__ import annotations

import os
import platform
import time

import torch

from pretrain.user_cache import read_value, write_value

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3"), GH200's H100
    ("H200", 989.0),  # SXM ("NVIDIA H200"), GH200
    ("B200", 2250.0),
    ("A100", 312.0),  # SXM and PCIe
    ("L40S", 362.0),
    ("A10G", 125.0),
    ("L4", 121.0),
)
"""Dense bf16 tensor-core peaks (TFLOP/s, half the datasheets' "with sparsity" figures) from NVIDIA datasheets, by a
part of the name ``torch.cuda.get_device_name`` gives; the first that matches counts, so the PCIe and NVL cards (lower
clocks and power) come before their SXM namesakes."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def datasheet_peak(device_name: str) -> float | None:
    """FLOP/s of the datasheet bf16 peak of a GPU whose name contains a known model, else None."""
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value * 1e12
    return None


def measured_matmul_peak(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> float:
    """FLOP/s of a large square matmul in ``dtype``: what this device actually reaches (n = 8192 on GPUs, 2048 on
    CPUs; repeated for about ``seconds``). Uses its own RNG: the global one is untouched."""
    n = 8192 if device.type == "cuda" else 2048
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
        if reps % 4 == 0:
            _sync(device)
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def _device_model(device: torch.device) -> str:
    """The device's model: the GPU's name, or the CPU's (``/proc/cpuinfo``'s model name where there is one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_spec(device: torch.device, dtype: torch.dtype, seconds: float) -> dict:
    """What a measured peak depends on (its cache spec): the device's type and model, the machine's CPU count, the
    dtype, torch's intra-op thread count and version, the measuring time."""
    return {
        "version": 1,
        "device": device.type,
        "model": _device_model(device),
        "cpus": os.cpu_count(),
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "seconds": seconds,
    }


def device_peak(device: torch.device, dtype: torch.dtype, seconds: float = 1.0) -> tuple[float, str]:
    """(FLOP/s, ``"datasheet"`` or ``"measured"``): the datasheet peak of a known GPU in bf16, else the measured
    matmul peak (CPUs, unknown GPUs, fp32), from the user's cache when it was measured before (:func:`peak_spec`)."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        sheet = datasheet_peak(torch.cuda.get_device_name(device))
        if sheet:
            return sheet, "datasheet"
    spec = peak_spec(device, dtype, seconds)
    cached = read_value("matmul-peak", spec)
    if isinstance(cached, float) and cached > 0:
        return cached, "measured"
    peak = measured_matmul_peak(device, dtype, seconds)
    write_value("matmul-peak", spec, peak)
    return peak, "measured"
