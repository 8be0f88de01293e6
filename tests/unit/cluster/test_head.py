"""The local head without starting Ray (``cluster/head.py``, ``cluster/head_procs.py``): its temp dir, and the
processes ``cluster down`` would end — the head's, never a shell or a reader of its logs, nothing after a restart.
Its recorded state, token, lock and temp dir's claim: ``test_head_state.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from cluster import head
from cluster.head_procs import head_processes, restart_mark


def test_two_state_directories_get_two_short_temp_dirs(tmp_path, monkeypatch):
    """Two heads of one user (two checkouts) never share a temp dir: ``down`` ends what works in its own."""
    dirs = []
    for name in ("a", "b", "a"):
        monkeypatch.setenv("PRETRAIN_RAY_HEAD_DIR", str(tmp_path / "checkout" / name / ".cache" / "ray-head"))
        dirs.append(head.default_temp_dir())
    assert dirs[0] == dirs[2] != dirs[1] and all(len(d) <= 60 for d in dirs)
    assert dirs[0].startswith(f"/tmp/pretrain-ray-{os.getuid()}-")


def test_a_process_in_the_heads_temp_dir_is_the_heads_only_if_it_runs_ray_or_its_python(tmp_path):
    temp = tmp_path / "ray-temp" / "session_latest" / "logs"
    temp.mkdir(parents=True)
    leader = _session_leader()
    state = {"sid": leader.pid, "started_at": time.time() - 1, "temp_dir": str(tmp_path / "ray-temp")}
    # own sessions (as a job's driver has), working in the head's temp dir: a reader of its logs and a Python
    reader = subprocess.Popen(["sleep", "30"], cwd=temp, start_new_session=True)
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=temp, start_new_session=True)
    # a job's driver under another Python (submit --python): `sh` stands in, named as it would be
    job = subprocess.Popen(["sh", "-c", "sleep 30", "-m", "pretrain"], cwd=temp, start_new_session=True)
    try:
        time.sleep(0.3)
        found = {p.pid for p in head_processes(state)}
        assert driver.pid in found and job.pid in found and reader.pid not in found, _seen(found, state, driver, job)
        assert leader.pid in {p.pid for p in head_processes({**state, "temp_dir": str(tmp_path / "elsewhere")})}
        # the machine or container restarted since the head started: its session id may be another's now
        assert head_processes({**state, "restart_mark": "another-boot:1"}) == []
        assert driver.pid in {p.pid for p in head_processes({**state, "restart_mark": restart_mark()})}
    finally:
        for p in (leader, reader, driver, job):
            p.kill()
            p.wait()


def test_the_temp_dir_is_recognised_through_a_symbolic_link(tmp_path):
    """``cluster up --temp-dir`` through a link, or a process that entered the directory by another path: the same
    directory either way."""
    real = tmp_path / "real" / "ray-temp"
    (real / "logs").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    leader = _session_leader()
    state = {"sid": leader.pid, "started_at": time.time() - 1, "temp_dir": str(tmp_path / "link" / "ray-temp")}
    driver = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], cwd=real / "logs", start_new_session=True
    )
    outside = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"], cwd=tmp_path, start_new_session=True
    )
    try:
        time.sleep(0.3)
        found = {p.pid for p in head_processes(state)}
        assert driver.pid in found and outside.pid not in found, _seen(found, state, driver, outside)
    finally:
        for p in (leader, driver, outside):
            p.kill()
            p.wait()


def _session_leader() -> subprocess.Popen:
    """A Python leading its own session, as ``ray start`` does under ``cluster up`` (whose pid the head records as its
    session). Not the test's own session: inside a PID namespace whose session leader lies outside it (as in a
    container), ``getsid`` answers 0."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)


def _seen(found: set, state: dict, *procs: subprocess.Popen) -> str:
    """What the search found and saw of each process, for a failure's message (a string: pytest shortens reprs)."""
    import psutil

    out = []
    for proc in procs:
        p = psutil.Process(proc.pid)
        seen = {"pid": proc.pid, "sid": os.getsid(proc.pid), "created_after": p.create_time() - state["started_at"]}
        try:
            seen["cwd"] = p.cwd()
            seen["exe"] = p.exe()
        except psutil.Error as e:
            seen["error"] = repr(e)
        out.append(seen)
    return json.dumps({"found": sorted(found), "state": state, "seen": out}, indent=1)
