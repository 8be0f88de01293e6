"""What a stop is, below the driver: a signal while the command ends a run (``stops_deferred``) prints a line and
does not cut the block short; the handlers before it are back after it."""

from __future__ import annotations

import os
import signal

from pretrain.train.stop_request import stops_deferred


def test_a_stop_during_the_block_is_a_line_and_the_handlers_come_back(capfd):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    done = False
    with stops_deferred("ending the run"):
        os.kill(os.getpid(), signal.SIGINT)  # Python's own handler would raise KeyboardInterrupt here
        os.kill(os.getpid(), signal.SIGTERM)  # the default action would end this process
        done = True
    assert done
    assert capfd.readouterr().err.splitlines() == [
        "[pretrain] SIGINT: ending the run",
        "[pretrain] SIGTERM: ending the run",
    ]
    assert {sig: signal.getsignal(sig) for sig in before} == before
