"""``python -m pretrain`` and the ``pretrain`` console command (pyproject.toml): the same entry point."""

import os
import sys


def main() -> int:
    # Quiet, local-only defaults, set before the stack reads them at import (users may override any of them).
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pretrain.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
