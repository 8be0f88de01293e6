"""The device the parity check (and ``generate``) runs on: checked in one line before any loading. The parity
itself is tested through whole exports in ``test_hf.py``."""

from __future__ import annotations

import pytest

from pretrain.config import ConfigError
from pretrain.export.parity import check_device


def test_check_device(gpus):
    gpus(0)
    check_device("export", "cpu")
    with pytest.raises(ConfigError) as e:
        check_device("export", "cuda:0")
    assert str(e.value) == "export --device cuda:0: no CUDA device is available here"
    with pytest.raises(ConfigError, match=r"^export --device: 'gpu' is not cpu, cuda or cuda:N$"):
        check_device("export", "gpu")
    gpus(2)
    for ok in ("cpu", "cuda", "cuda:0", "cuda:1"):
        check_device("generate", ok)
    with pytest.raises(ConfigError) as e:
        check_device("generate", "cuda:2")
    assert str(e.value) == "generate --device cuda:2: this machine has 2 CUDA device(s), cuda:0 to cuda:1"


def test_export_refuses_a_device_it_lacks_before_loading(gpus, tmp_path):
    from pretrain.export.hf import main

    gpus(1)
    with pytest.raises(ConfigError) as e:
        main(["/no/such/checkpoint", "--out", str(tmp_path / "out"), "--device", "cuda:3"])
    assert str(e.value) == "export --device cuda:3: this machine has 1 CUDA device(s), cuda:0 to cuda:0"
    assert not (tmp_path / "out").exists()
