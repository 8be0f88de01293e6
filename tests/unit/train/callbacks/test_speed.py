"""The loop's speed measures (fast): the start-up timeline's phases add up to the time to the first step, and the
loop's steady-state tokens/s (mean and best window) leave out the warm-up and count everything between steps."""

from __future__ import annotations

import time

import pytest

from pretrain import timeline
from pretrain.train.callbacks.speed import LOOP_WARMUP_STEPS, cycle, loop_rates


def test_process_start_is_this_process_start():
    import psutil

    start = timeline.process_start()
    # in a full suite this process started long ago: compare with the OS's own record, not with "now"
    assert abs(start - psutil.Process().create_time()) < 2.0  # psutil: boot time in whole seconds
    assert start <= time.time()
    assert start <= timeline._IMPORTED_AT + 0.05, "the process started before it imported this module"


def test_phases_add_up_and_repeated_phases_sum():
    marks = [
        ("imports", 100.0),
        ("run_preparation", 101.0),
        ("tokenizer", 103.0),
        ("run_preparation", 103.5),
        ("ray", 104.0),
        ("first_step", 110.0),
    ]
    got = timeline.phases(marks, 111.0)
    assert got == {"imports": 1.0, "run_preparation": 2.5, "tokenizer": 0.5, "ray": 6.0, "first_step": 1.0}
    assert list(got) == ["imports", "run_preparation", "tokenizer", "ray", "first_step"]
    assert sum(got.values()) == 111.0 - 100.0


def test_timeline_is_a_noop_until_started_and_a_worker_adopts_the_drivers_marks():
    timeline.finish()
    timeline.enter("tokenizer")  # library use outside a command: nothing recorded
    assert timeline.marks() == []
    timeline.start()
    timeline.enter("run_preparation")
    driver = timeline.marks()
    assert [p for p, _ in driver] == ["imports", "run_preparation"] and driver[0][1] <= driver[1][1]
    timeline.adopt([list(m) for m in driver])  # the same process (no Ray): nothing changes
    assert timeline.marks() == driver
    timeline.finish()
    timeline.adopt([list(m) for m in driver])  # a worker process: continues the driver's timeline
    timeline.enter("worker_setup")
    assert [p for p, _ in timeline.marks()] == ["imports", "run_preparation", "worker_setup"]
    timeline.finish()
    assert timeline.marks() == []


def test_loop_rates_leave_out_warmup_and_count_periodic_work():
    tokens = 1000
    ends = [0.0, 5.0, 6.0, 7.0, 8.0, 9.0]  # a slow first step, then 1 s per step
    ends += [ends[-1] + 1.0 * (i + 1) + 0.5 * ((i + 1) // 10) for i in range(40)]  # every 10th step 0.5 s more
    mean, best, steps = loop_rates(ends, tokens, window=10)
    assert steps == len(ends) - 1 - LOOP_WARMUP_STEPS
    assert mean == pytest.approx(steps * tokens / (ends[-1] - ends[LOOP_WARMUP_STEPS]))
    assert best == pytest.approx(10 * tokens / 10.5), "every 10-step window holds one periodic cost"
    assert loop_rates([0.0, 1.0], tokens, window=10) == (1000.0, 1000.0, 1)  # too short for a warm-up
    assert loop_rates([3.0], tokens, window=10) == (0.0, 0.0, 0)


def test_window_is_a_whole_number_of_logging_and_health_cycles():
    assert cycle(10, 10) == 10 and cycle(10, 4) == 20 and cycle(5, 0) == 5 and cycle(1, 1) == 1


def test_a_growths_rebuild_is_not_step_time_and_each_step_counts_its_models_flops():
    """Growth rebuilds the model inside a step's start (``on_model_changed``): the progress line's tokens/s and
    ``train/mfu`` leave the rebuild out, and MFU counts each step at the FLOPs of the model it trained."""
    from types import SimpleNamespace

    from pretrain.train.callbacks.speed import SpeedMonitor
    from pretrain.train.callbacks.utilization import ThroughputMonitor
    from pretrain.train.progress import Progress

    trainer = SimpleNamespace(progress=Progress(10, 0, 100, False), shared=SimpleNamespace(data_wait_s=0.0))
    speed, mfu = SpeedMonitor(), ThroughputMonitor()
    speed.ends = [0.0]  # not the first step (no start-up report)
    mfu.peak, mfu.tokens_per_step, mfu.flops_per_token = 1e9, 100, 1e6
    sizes = iter([3e6])
    mfu._model_flops = lambda trainer: setattr(mfu, "flops_per_token", next(sizes))  # the grown model's count
    for grow in (False, True):
        speed.on_step_start(trainer, 1)
        mfu.on_step_start(trainer, 1)
        if grow:
            time.sleep(0.5)  # the rebuild
            speed.on_model_changed(trainer)
            mfu.on_model_changed(trainer)
        time.sleep(0.05)
        speed.on_step_end(trainer, None)
        mfu.on_step_end(trainer, None)
    assert trainer.progress.train_seconds < 0.3, trainer.progress.train_seconds
    step_s = mfu._step_s
    assert step_s == trainer.progress.train_seconds, "tokens/s and MFU are measured over the same step time"
    assert mfu.extra_metrics()["train/mfu"] == pytest.approx((1e6 + 3e6) * 100 / step_s / 1e9)
