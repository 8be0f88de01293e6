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
