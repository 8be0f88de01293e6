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


def test_a_stop_asked_during_the_last_step_leaves_the_finished_run_as_it_is(tmp_path):
    """A stop request read after step ``max_steps`` finds the run done: no stop (the run ends FINISHED with its
    summary); one read after an earlier step stops the run after it."""
    from types import SimpleNamespace

    from pretrain.train.callbacks.stopping import StopOnRequest
    from pretrain.train.stop_request import write_request

    write_request(tmp_path, "SIGTERM")
    stops: list[str] = []
    for step, stopped in ((4, []), (3, ["SIGTERM"])):
        trainer = SimpleNamespace(
            run_dir=tmp_path,
            ctx=SimpleNamespace(is_main=True, world_size=1),
            state=SimpleNamespace(step=step),
            cfg=SimpleNamespace(train=SimpleNamespace(max_steps=4)),
            progress=SimpleNamespace(say=lambda line: None),
            stop=stops.append,
        )
        StopOnRequest().on_step_end(trainer, None)
        assert stops == stopped
