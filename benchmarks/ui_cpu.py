"""The CPU and memory that ``./launch.sh ui`` takes with and without MLflow's job runner (GenAI jobs): the whole
process session of the command, CPU from its start until the UI answers ``/health`` and after an idle window, and
the resident memory of its processes then; printed for both settings, and the CPU as a ratio, measured in one run.
``ui`` leaves the runner off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``) unless the environment sets it.

    .venv/bin/python -m benchmarks.ui_cpu [--idle-s 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import psutil


def _session_cpu(sid: int) -> tuple[float, int, float]:
    """(CPU seconds of the live processes of session ``sid``, how many there are, their resident memory in MiB)."""
    total, count, rss = 0.0, 0, 0.0
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
                rss += proc.memory_info().rss / 2**20
                count += 1
        except (OSError, psutil.Error):
            continue
    return total, count, rss


def measure(job_execution: bool, idle_s: float, port: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ui-cpu-") as work:
        env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": str(job_execution).lower(),
        }
        cmd = [sys.executable, "-m", "pretrain", "ui", "--port", str(port)]
        ui = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        start, seen = time.monotonic(), 0.0
        try:
            while True:  # the session's CPU, sampled: a process that ends takes its counts with it
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                        break
                except OSError:
                    seen = max(seen, _session_cpu(ui.pid)[0])
                    time.sleep(0.3)
                    if ui.poll() is not None or time.monotonic() - start > 300:
                        raise RuntimeError("the UI did not come up") from None
            up_s = time.monotonic() - start
            at_up = max(seen, _session_cpu(ui.pid)[0])
            time.sleep(idle_s)
            after, processes, rss = _session_cpu(ui.pid)
        finally:
            os.killpg(ui.pid, signal.SIGTERM)
            ui.wait(timeout=60)
    return {
        "up_s": up_s,
        "cpu_at_up_s": at_up,
        "cpu_after_idle_s": max(after, at_up),
        "processes": processes,
        "rss_mib": rss,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ui_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--idle-s", type=float, default=20.0, help="idle window after the UI answers (default 20)")
    p.add_argument("--port", type=int, default=5131)
    a = p.parse_args(argv)
    rows = {name: measure(on, a.idle_s, a.port) for name, on in (("job runner on", True), ("off (ui)", False))}
    print(f"{'':<15} {'up (s)':>7} {'CPU at up':>10} {f'CPU +{a.idle_s:g} s idle':>16} {'processes':>10} {'MiB':>7}")
    for name, r in rows.items():
        print(
            f"{name:<15} {r['up_s']:>7.1f} {r['cpu_at_up_s']:>10.1f} {r['cpu_after_idle_s']:>16.1f} "
            f"{r['processes']:>10} {r['rss_mib']:>7.0f}"
        )
    on, off = rows["job runner on"]["cpu_after_idle_s"], rows["off (ui)"]["cpu_after_idle_s"]
    print(f"CPU with the runner / without: {on / off:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
