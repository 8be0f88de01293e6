"""Model code is single-device, checked on the source: neither ``torch.distributed`` nor a rank or world size in any
signature of the model package. The import-linter contracts (``.importlinter``: the package layers and
``pretrain.model`` importing neither DeepSpeed nor Ray) run in ``tests/integration/house/test_layers.py``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


_PARALLEL_NAMES = {"rank", "world_size", "world", "ep_rank", "ep_size", "local_rank", "process_group"}


def test_model_code_is_single_device():
    """No rank, world size or process group reaches model code: expert parallelism and sharding are applied from
    ``pretrain.parallel`` (``expert.py``, ``sequence.py``, ``tensor.py``) and the DeepSpeed engine."""
    offenders = []
    files = sorted((ROOT / "pretrain" / "model").glob("*.py"))
    assert len(files) >= 5
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                offenders += [
                    f"{f.name}:{node.lineno} import {a.name}"
                    for a in node.names
                    if a.name.startswith("torch.distributed")
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                offenders.append(f"{f.name}:{node.lineno} from {node.module}")
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
                and node.attr == "distributed"
            ):
                offenders.append(f"{f.name}:{node.lineno} torch.distributed")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                offenders += [f"{f.name}:{node.lineno} {node.name}({a.arg})" for a in args if a.arg in _PARALLEL_NAMES]
    assert not offenders, offenders
