"""``python -m pretrain`` and the ``pretrain`` console command (pyproject.toml): the same entry point."""

import os
import sys
from typing import NoReturn


def main() -> int:
    # Quiet, local-only defaults, set before the stack reads them at import (users may override any of them).
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if pauses_collection():  # until the first step (or Ray's workers take over)
        from pretrain import startup_gc

        startup_gc.pause()
    from pretrain.cli import main as cli_main

    exit_without_teardown(cli_main())


def pauses_collection() -> bool:
    """Whether this command trains (in this process, or through Ray): its start-up runs with the garbage
    collector paused (:mod:`pretrain.startup_gc`)."""
    return sys.argv[1:2] in (["train"], ["resume"])


def exit_without_teardown(code: int) -> NoReturn:
    """End the command as the interpreter would — non-daemon threads joined, ``atexit`` handlers run (Ray's
    shutdown, MLflow's, multiprocessing's joins, file locks), output flushed — but without tearing down the
    modules: freeing torch, DeepSpeed, MLflow and Ray object by object, after every command that imported them,
    costs far more than the handlers themselves (seconds on a small or loaded machine), time a user waits for
    nothing after the last line."""
    import atexit
    import threading

    # The interpreter's own order: threading's exit hooks (they shut down thread pools, e.g. the data prefetcher's
    # and MLflow's executors, whose workers would otherwise wait forever), joining non-daemon threads, then atexit.
    threading._shutdown()  # type: ignore[attr-defined]  # private: the interpreter's own exit hook
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    sys.exit(main())
