"""One process trains a run at a time (``pretrain/driver/run_lock.py``): a second holder is refused in one line
naming the first, the lock is free again when the holder's context ends, and when its process is killed (the
kernel releases ``flock``; MLflow's RUNNING status would stay). The refusal through the CLI, while a run trains, is
in ``tests/integration/train/test_stop.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pretrain.config import ConfigError
from pretrain.driver.run_lock import LOCK_FILE, hold_run


def test_a_second_holder_is_refused_until_the_first_ends_or_is_killed(tmp_path):
    with hold_run(tmp_path, "r1"):
        with pytest.raises(ConfigError) as e:
            with hold_run(tmp_path, "r1"):
                pass
        assert str(e.value).startswith(f"run r1 is training in another process (pid {os.getpid()} on ")
    with hold_run(tmp_path, "r1"):  # released at the end of the context
        pass

    code = (
        "import time\nfrom pretrain.driver.run_lock import hold_run\n"
        f"with hold_run({str(tmp_path)!r}, 'r1'):\n    print('held', flush=True)\n    time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {proc.pid} on "):
            with hold_run(tmp_path, "r1"):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with hold_run(tmp_path, "r1"):  # the killed holder left nothing to clean up
        assert (tmp_path / LOCK_FILE).is_file()
