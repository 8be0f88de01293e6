"""``pretrain/ds_adapter/engine.py``: a module's ``torch.compile`` set up when each compiled function is first called
(DeepSpeed's Muon kernels; ``tests/unit/train/test_dist.py`` checks a worker's start imports Muon without it)."""

from __future__ import annotations

import sys

import torch

from pretrain.ds_adapter import import_compiling_on_first_call


def test_a_module_imports_without_compiling_and_compiles_each_function_on_its_first_call(tmp_path, monkeypatch):
    """Both decorator forms, with their options; nothing compiled at import, each function compiled once, at its
    first call, by torch's own ``torch.compile`` with the function's options; ``torch.compile`` is torch's after
    the import; an absent module is skipped, an imported one left alone."""
    (tmp_path / "compiled_at_import.py").write_text(
        "import torch\n\n"
        "@torch.compile\n"
        "def double(x):\n    return 2 * x\n\n"
        "@torch.compile(backend='eager', dynamic=False)\n"
        "def shift(x, by=1):\n    return x + by\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "compiled_at_import", raising=False)
    real, calls = torch.compile, []

    def recording(model=None, **options):
        calls.append((getattr(model, "__name__", model), options))
        return lambda *a, **k: model(*a, **k)  # stands for the compiled function

    monkeypatch.setattr(torch, "compile", recording)
    import_compiling_on_first_call("compiled_at_import")
    assert torch.compile is recording, "the real torch.compile is back after the import"
    mod = sys.modules["compiled_at_import"]
    assert calls == [] and mod.double.__name__ == "double" and mod.shift.__name__ == "shift"
    x = torch.arange(3.0)
    assert torch.equal(mod.shift(x, by=2), x + 2) and torch.equal(mod.shift(x), x + 1)
    assert torch.equal(mod.double(x), 2 * x)
    assert calls == [("shift", {"backend": "eager", "dynamic": False}), ("double", {})], "once each, when first called"
    monkeypatch.setattr(torch, "compile", real)
    import_compiling_on_first_call("compiled_at_import")  # imported already: left alone
    assert sys.modules["compiled_at_import"] is mod
    import_compiling_on_first_call("no_such_module_here")
    assert "no_such_module_here" not in sys.modules and torch.compile is real


def test_the_shared_memory_op_is_left_alone_on_a_gpu_accelerator(monkeypatch):
    """A world of one marks DeepSpeed's CPU all-reduce op incompatible on the CPU accelerator only: on another
    ``deepspeed.ops.__compatible_ops__`` is not read (reading it probes every op builder: compilers and GPUs queried
    in subprocesses, in every process)."""
    import types

    from pretrain.ds_adapter import engine

    class Ops(types.ModuleType):
        def __getattr__(self, name):
            raise AssertionError(f"deepspeed.ops.{name} read")

    ops = Ops("deepspeed.ops")
    package = types.ModuleType("deepspeed")
    package.ops = ops  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", package)
    monkeypatch.setitem(sys.modules, "deepspeed.ops", ops)
    monkeypatch.setattr(engine, "loaded_accelerator", lambda: "cuda")
    engine.skip_shm_comm_op(1)
    monkeypatch.setattr(engine, "loaded_accelerator", lambda: "cpu")
    compatible: dict = {}
    ops.__dict__["__compatible_ops__"] = compatible
    engine.skip_shm_comm_op(2)
    assert compatible == {}
    engine.skip_shm_comm_op(1)
    assert compatible == {engine.SHM_COMM_OP: False}
