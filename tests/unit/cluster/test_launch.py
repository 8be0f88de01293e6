"""What every command sets up for the CUDA allocator, and what Ray's workers get of it (``cluster/launch.py``)."""

from __future__ import annotations

from cluster.launch import worker_env
from pretrain.cli import CUDA_ALLOC_CONF, main


def test_the_cuda_allocator_setting_reaches_the_workers_unless_the_user_set_it(monkeypatch, capsys):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # so that the test's end restores the variable as it was
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert main(["no-such-command"]) == 2  # set before the command runs (and before torch sees CUDA)
    assert CUDA_ALLOC_CONF == "expandable_segments:True"
    assert worker_env()["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert main(["no-such-command"]) == 2
    assert worker_env()["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    capsys.readouterr()
