"""The package import arrows go one way: the import-linter contracts in ``.importlinter`` (repository root).

    pretrain.cli > eval > cluster > pretrain.export > pretrain.train > pretrain.checkpoint > pretrain.model | pretrain.data
    > pretrain.config

plus the single-device model rule (``pretrain.model`` imports neither DeepSpeed nor Ray), and, checked here on
the source, neither ``torch.distributed`` nor a rank or world size in any signature of the model package.

Run by hand: ``PYTHONPATH=. .venv/bin/lint-imports``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The lint-imports entry point, run by this interpreter (the venv's: import-linter is pinned in requirements.txt).
_LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_import_layers():
    assert (ROOT / ".importlinter").is_file()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}  # COLUMNS: no wrapped lines
    proc = subprocess.run([sys.executable, "-c", _LINT, "--config", ".importlinter", "--no-cache", "--no-logo"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    if "No module named 'importlinter'" in output:
        raise AssertionError("import-linter is not installed: .venv/bin/pip install -r requirements.txt")
    print(output)
    assert proc.returncode == 0, f"import layering contract broken (lint-imports exit {proc.returncode}):\n{output}"
    assert "0 broken" in output, output


_PARALLEL_NAMES = {"rank", "world_size", "world", "ep_rank", "ep_size", "local_rank", "process_group"}


def test_model_code_is_single_device():
    """No rank, world size or process group reaches model code: expert parallelism and sharding are applied from
    ``pretrain.train`` (``expert_parallel.py``, the DeepSpeed engine)."""
    offenders = []
    files = sorted((ROOT / "pretrain" / "model").glob("*.py"))
    assert len(files) >= 5
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                offenders += [f"{f.name}:{node.lineno} import {a.name}" for a in node.names
                              if a.name.startswith("torch.distributed")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                offenders.append(f"{f.name}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch" \
                    and node.attr == "distributed":
                offenders.append(f"{f.name}:{node.lineno} torch.distributed")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                offenders += [f"{f.name}:{node.lineno} {node.name}({a.arg})" for a in args
                              if a.arg in _PARALLEL_NAMES]
    assert not offenders, offenders
