"""Training batches and the data-throughput probe (``pretrain/data/batches.py``)."""

from __future__ import annotations

import pytest
import torch

from pretrain.data import data_throughput
from tests.unit.data.common import T, data_cfg

pytestmark = pytest.mark.usefixtures("datasets_cache")


def test_data_throughput_is_positive(corpus, tok):
    cfg = data_cfg(corpus)
    threads = torch.get_num_threads()
    assert data_throughput(cfg, kind="decoder", seq_len=T, tokenizer=tok, seconds=0.3) > 1000
    assert data_throughput(cfg, kind="encoder", seq_len=T, tokenizer=tok, seconds=0.3) > 1000
    assert torch.get_num_threads() == threads  # restored after measuring with one thread
