"""``train.compile``: which setting compiles the blocks, per device and ZeRO stage, and how the key reads. Compiled
blocks against eager ones: ``tests/integration/train/test_compiled_blocks.py``."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import load_config


def test_compile_setting_resolves_per_device():
    from pretrain.config import ConfigError
    from pretrain.train.module import compile_wanted

    cpu = torch.device("cpu")
    assert not compile_wanted("auto", cpu) and not compile_wanted("no", cpu) and compile_wanted("yes", cpu)
    # ZeRO-3's parameter hooks run inside the blocks: auto leaves them eager, yes is refused at load
    assert not compile_wanted("auto", torch.device("cuda", 0), zero_stage=3)
    with pytest.raises(ConfigError, match=r"^train.compile: yes is not supported with zero.stage 3"):
        load_config(None, ["train.compile=yes", "zero.stage=3"])
    assert load_config(None, ["train.compile=yes"]).train.compile == "yes"  # YAML reads yes/no as booleans
    assert load_config(None, ["train.compile=off"]).train.compile == "no"
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["train.compile=sometimes"])


def test_compile_on_cuda_needs_triton_a_c_compiler_and_the_python_headers(monkeypatch, tmp_path):
    """Triton builds its kernel launcher with a C compiler and Python.h at the first compiled step: where either is
    missing, ``train.compile: auto`` stays eager (and ``yes`` is refused) instead of failing at that step."""
    import shutil
    import sys
    import sysconfig
    import types

    from pretrain.model.compile import compile_supported

    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(sys.modules, "triton", None)  # not installed
    assert compile_supported(cuda) == (False, "torch.compile on CUDA needs triton (pip install triton)")
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/cc" if name == "cc" else None)  # Triton takes no cc
    ok, why = compile_supported(cuda)
    assert not ok and why.startswith("torch.compile on CUDA needs a C compiler")
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda scheme=None: {**paths, "include": str(tmp_path)})
    ok, why = compile_supported(cuda)
    assert not ok and why.endswith(f"(no {tmp_path}/Python.h)")
    (tmp_path / "Python.h").write_text("")
    assert compile_supported(cuda) == (True, "")
