"""The package import arrows go one way: the import-linter contracts in ``.importlinter`` (repository root).

    pretrain.cli > eval > cluster > pretrain.export > pretrain.train > pretrain.checkpoint
    > pretrain.model | pretrain.data > pretrain.config

plus the single-device model rule (``pretrain.model`` imports neither DeepSpeed nor Ray; the rest of that rule is
checked on the source in ``tests/unit/house/test_layers.py``), run by ``lint-imports`` in a subprocess.

Run by hand: ``PYTHONPATH=. .venv/bin/lint-imports``.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT

# The lint-imports entry point, run by this interpreter (the venv's: import-linter is pinned in requirements.txt).
_LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_import_layers():
    assert (ROOT / ".importlinter").is_file()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}  # COLUMNS: no wrapped lines
    proc = subprocess.run(
        [sys.executable, "-c", _LINT, "--config", ".importlinter", "--no-cache", "--no-logo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    if "No module named 'importlinter'" in output:
        raise AssertionError("import-linter is not installed: .venv/bin/pip install -r requirements.txt")
    print(output)
    assert proc.returncode == 0, f"import layering contract broken (lint-imports exit {proc.returncode}):\n{output}"
    assert "0 broken" in output, output
