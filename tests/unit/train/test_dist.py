"""Which device a worker takes (``pretrain/train/dist.py``): one GPU per local worker or none, the GPU Ray or the
local rank names, and DeepSpeed's accelerator matched to the run's device."""

from __future__ import annotations

import sys

import pytest
import torch

from pretrain.train import dist


def test_every_local_worker_gets_its_own_gpu_or_the_run_is_on_the_cpu(gpus):
    gpus(1)
    assert dist.gpu_count("auto", 1) == 1
    assert dist.gpu_count("auto", 2) == 0  # two workers on one GPU: NCCL refuses them; auto runs them on the CPU
    with pytest.raises(ValueError, match=r"^cluster.use_gpu: yes, with 2 workers on this node but 1 GPU\(s\)"):
        dist.gpu_count("yes", 2)
    assert dist.gpu_count("no", 1) == 0
    gpus(8)
    assert dist.gpu_count("auto", 8) == 8 and dist.gpu_count("yes", 4) == 8
    gpus(0)
    assert dist.gpu_count("auto", 1) == 0
    with pytest.raises(ValueError, match=r"^cluster.use_gpu: yes, but torch \S+ cannot use a GPU on this node \("):
        dist.gpu_count("yes", 1)  # a CPU build, or a driver too old for the CUDA torch was built for: never the CPU


def test_the_gpu_is_the_one_ray_assigned_else_the_local_ranks(gpus):
    gpus(4)
    assert dist.gpu_device(1, torch.device("cuda", 3)) == torch.device("cuda", 3)  # Ray's order, not the rank's
    assert dist.gpu_device(2) == torch.device("cuda", 2)  # torchrun: every worker sees the node's GPUs
    gpus(1)
    assert dist.gpu_device(5) == torch.device("cuda", 0)  # one GPU per task (Slurm --gpus-per-task=1)


def test_deepspeed_gets_the_runs_accelerator(monkeypatch):
    """A CPU run on a GPU node, or a GPU worker of a driver without a GPU (which set DS_ACCELERATOR=cpu)."""
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    dist.match_deepspeed_accelerator(False)
    assert dist.os.environ["DS_ACCELERATOR"] == "cpu"
    dist.match_deepspeed_accelerator(True)
    assert dist.os.environ["DS_ACCELERATOR"] == "cuda"
    monkeypatch.undo()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # restored after the test
    import deepspeed  # noqa: F401  (imported with this machine's CPU accelerator)

    with pytest.raises(RuntimeError, match="^DeepSpeed was imported with its cpu accelerator before this cuda run"):
        dist.match_deepspeed_accelerator(True)
    dist.match_deepspeed_accelerator(False)


def test_a_worker_imports_deepspeed_without_mlflow_until_it_tracks():
    """``setup`` imports DeepSpeed (its accelerator chosen) with its autotuner's ``import mlflow`` held back, in a
    fresh interpreter as a worker starts: MLflow is not imported by it (the ranks that do not track never import
    it), DeepSpeed's autotuner goes without it, and a later ``import mlflow`` (the tracking rank's) works. Its Muon
    optimizer is imported without setting up ``torch.compile`` (no ``torch._dynamo``), and ``torch.compile`` is
    torch's own again."""
    import subprocess

    from tests.harness import PYTHON, ROOT

    code = (
        "import sys; from pretrain.train import dist; dist.setup('no')\n"
        "assert 'deepspeed' in sys.modules and 'mlflow' not in sys.modules, [m for m in sys.modules if 'mlf' in m]\n"
        "from deepspeed.autotuning import autotuner; assert autotuner.has_mlflow is False\n"
        "import torch; from pretrain.ds_adapter import MUON_MODULE; assert MUON_MODULE in sys.modules\n"
        "assert 'torch._dynamo' not in sys.modules and torch.compile.__module__ == 'torch', torch.compile\n"
        "from pretrain.ds_adapter import import_deepspeed; assert import_deepspeed() is sys.modules['deepspeed']\n"
        "import mlflow; print(mlflow.MlflowClient.__name__)\n"
    )
    proc = subprocess.run([PYTHON, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "MlflowClient", proc.stderr[-3000:]
