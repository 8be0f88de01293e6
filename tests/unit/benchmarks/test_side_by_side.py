"""``benchmarks.side_by_side``: tasks in spawned processes, at most N at a time on disjoint CPUs, results in order,
the first failure stops the rest and names its task."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.side_by_side import core_sets, cpus, run_side_by_side

ROOT = Path(__file__).resolve().parents[3]


def _where(name: str, pause: float) -> tuple[str, list[int], int]:
    time.sleep(pause)
    print(f"{name} says hello")
    return name, sorted(os.sched_getaffinity(0)), os.getpid()


def _fail(path: str) -> None:
    raise ValueError(f"no such thing as {path}")


def test_core_sets_split_the_cpus_into_disjoint_contiguous_shares():
    assert core_sets(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert core_sets(1, [3, 5]) == [[3, 5]]
    assert core_sets(3, [0, 1, 2]) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="between 1 and the 2 CPUs"):
        core_sets(3, [0, 1])


@pytest.mark.skipif(len(cpus()) < 2, reason="needs two CPUs")
def test_tasks_run_at_most_n_at_a_time_on_their_own_cpus_in_order(capfd):
    done = []
    tasks = [(f"task {i}", _where, (f"task {i}", 0.2)) for i in range(3)]
    results = run_side_by_side(iter(tasks), 2, lambda i, result: done.append(i))
    assert [r[0] for r in results] == ["task 0", "task 1", "task 2"]
    assert len({r[2] for r in results} | {os.getpid()}) == 4, "each task in a process of its own"
    first, second = core_sets(2, cpus())
    assert results[0][1] == first and results[1][1] == second, "side by side on disjoint CPUs"
    assert results[2][1] in (first, second), "the third takes the CPUs of the one that ended"
    assert sorted(done) == [0, 1, 2]
    out = capfd.readouterr().out
    assert "[task 1] task 1 says hello" in out, out


@pytest.mark.skipif(len(cpus()) < 2, reason="needs two CPUs")
def test_the_first_failure_names_its_task_and_stops_the_others():
    tasks = [("slow", _where, ("slow", 60.0)), ("broken", _fail, ("/nowhere",))]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)broken failed:.*ValueError: no such thing as /nowhere"):
        run_side_by_side(tasks, 2)
    assert time.monotonic() - t0 < 30, "the slow task was stopped, not waited for"


def _pid_then_sleep(path: str) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_a_task_does_not_outlive_its_parent(tmp_path, how):
    """Killed (the kernel's parent-death signal) or stopped (SIGTERM raises in the parent, which stops its tasks):
    no task goes on running for nobody."""
    pid_file = tmp_path / "pid"
    code = (
        "from benchmarks.side_by_side import run_side_by_side\n"
        "from tests.unit.benchmarks.test_side_by_side import _pid_then_sleep\n"
        f"run_side_by_side([('sleeper', _pid_then_sleep, ({str(pid_file)!r},))], 1)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not pid_file.is_file() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, "the task never started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        parent.send_signal(how)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while _alive(child):
            assert time.monotonic() < deadline, f"the task outlived its parent ({how.name})"
            time.sleep(0.1)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").is_dir() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
