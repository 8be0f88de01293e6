"""What every command sets up for the CUDA allocator and what Ray's workers get of it, the line of a job trained
alone, the note on restarts without Ray, and a run created before a failing import is ended
(``cluster/launch.py``)."""

from __future__ import annotations

import sys

import pytest

from cluster.launch import _prepare_then_import, alone_note, restarts_note, worker_env
from pretrain.cli import CUDA_ALLOC_CONF, main
from pretrain.config import ClusterConfig


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


def test_a_job_of_several_workers_trained_alone_says_so():
    """``cluster.use_ray=false`` with 2 workers and no launcher trains as 1 worker: one line says so and how to run
    2; under torchrun (``WORLD_SIZE`` 2), or with 1 worker, nothing is said."""
    two = ClusterConfig(num_workers=2, use_ray=False)
    line = alone_note(two, {})
    assert line is not None and "\n" not in line
    assert "cluster.num_workers=2" in line and "torchrun --nproc_per_node 2" in line
    assert alone_note(two, {"WORLD_SIZE": "2"}) is None
    assert alone_note(ClusterConfig(num_workers=1, use_ray=False), {}) is None


def test_restarts_asked_of_a_job_without_ray_get_a_note():
    """``cluster.max_failures`` is Ray Train's: without Ray (``cluster.use_ray=false``) the run says it has no effect
    (``run``, for ``train`` and ``resume`` alike); with Ray, or with no restarts asked, there is no note."""
    note = restarts_note(ClusterConfig(use_ray=False, max_failures=2))
    assert note and "cluster.max_failures=2 has no effect with cluster.use_ray=false" in note
    assert restarts_note(ClusterConfig(use_ray=True, max_failures=2)) is None
    assert restarts_note(ClusterConfig(use_ray=False)) is None


def test_a_failing_torch_import_after_the_run_is_created_abandons_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    abandoned = []
    with pytest.raises(ImportError):
        _prepare_then_import(lambda: "run", lambda run, e: abandoned.append((run, isinstance(e, ImportError))))
    assert abandoned == [("run", True)], "the created run is ended, not left RUNNING"
    monkeypatch.undo()
    assert _prepare_then_import(lambda: "run", lambda run, e: abandoned.append(run)) == "run"
    assert len(abandoned) == 1
