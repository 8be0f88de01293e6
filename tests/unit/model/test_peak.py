"""The datasheet peaks MFU is measured against (``pretrain/model/peak.py``), matched on the names
``torch.cuda.get_device_name`` gives."""

from __future__ import annotations

import pytest
import torch

from pretrain.model.peak import datasheet_peak, device_peak


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA B200", 2250.0),
    ],
)
def test_each_card_gets_its_own_datasheet_peak(name, tflops):
    assert datasheet_peak(name) == tflops * 1e12


def test_an_unknown_device_is_measured():
    assert datasheet_peak("Tesla T4") is None
    peak, source = device_peak(torch.device("cpu"), torch.float32, seconds=0.05)
    assert source == "measured" and peak > 0


def test_the_measured_peak_is_measured_once_per_machine_dtype_and_threads(cache, monkeypatch):
    """``device_peak`` keeps a measured peak in the user's cache: the second call reads it; another dtype or thread
    count measures again."""
    from pretrain.model import peak as peak_module

    measured = []
    monkeypatch.setattr(peak_module, "measured_matmul_peak", lambda d, t, s: measured.append(t) or 1e9 * len(measured))
    cpu = torch.device("cpu")
    assert device_peak(cpu, torch.float32, 0.05) == (1e9, "measured")
    assert device_peak(cpu, torch.float32, 0.05) == (1e9, "measured") and len(measured) == 1
    assert device_peak(cpu, torch.bfloat16, 0.05) == (2e9, "measured")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert device_peak(cpu, torch.float32, 0.05) == (3e9, "measured")
    finally:
        torch.set_num_threads(threads)
    assert device_peak(cpu, torch.float32, 0.05) == (1e9, "measured") and len(measured) == 3


def test_a_run_faster_than_its_peak_says_once_that_the_peak_is_stale(capsys):
    """A measured peak kept from a busy machine makes MFU exceed 100 %: the run says so once, naming the cache."""
    from pretrain.train.callbacks.utilization import ThroughputMonitor

    monitor = ThroughputMonitor()
    monitor.peak, monitor.peak_source, monitor.flops_per_token, monitor.tokens_per_step = 1e9, "measured", 1e6, 1000
    lines = []
    monitor._say = lines.append
    for _ in range(2):
        monitor._steps, monitor._step_s, monitor._flops = 1, 0.5, 1e9  # 2e9 model FLOP/s against a 1e9 peak
        assert monitor.extra_metrics()["train/mfu"] == pytest.approx(2.0)
    assert len(lines) == 1 and "MFU 200% is above 100 %" in lines[0] and "matmul-peak" in lines[0], lines
