"""Watching and stopping submitted jobs: ``./launch.sh jobs | status JOB | logs JOB [--follow] | stop JOB``, each
with ``--address URL`` (resolved as for ``submit``: :func:`cluster.connection.resolve_address`). Submission:
:mod:`cluster.submit`; the connection and the token: :mod:`cluster.connection`."""

from __future__ import annotations

import argparse
import sys
import time

from cluster.connection import api_errors, call_api, check_job_id, connect, resolve_address
from cluster.head import ClusterError, seconds
from cluster.submit import STOP_WAIT_KEY, TERMINAL
from pretrain.config.errors import ArgumentParser, without_passwords


def _address_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="Jobs API address (default: RAY_ADDRESS, else the local head)")


def _fmt_time(ms: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def _fmt_duration(start: int | None, end: int | None) -> str:
    if not start:
        return "-"
    s = int(((end or time.time() * 1000) - start) / 1000)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def jobs(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh jobs", description="jobs submitted to the cluster")
    _address_arg(p)
    a = p.parse_args(argv)
    address = resolve_address(a.address)
    client = connect(address)
    listed = [
        j
        for j in call_api(client, address, client.list_jobs)
        if str(getattr(j.type, "value", j.type)) == "SUBMISSION" and j.submission_id
    ]
    if not listed:
        print(f"no jobs at {without_passwords(address)}")
        return 0
    listed.sort(key=lambda j: j.start_time or 0)
    print(f"jobs at {without_passwords(address)}")
    print(f"{'job id':<30} {'status':<10} {'started':<19} {'duration':>9}  {'config':<16} message")
    for j in listed:
        msg = (j.message or "").strip().splitlines()[0][:60] if j.message else ""
        cfg = (j.metadata or {}).get("pretrain_config", "-")
        print(
            f"{j.submission_id:<30} {str(j.status.value):<10} {_fmt_time(j.start_time):<19} "
            f"{_fmt_duration(j.start_time, j.end_time):>9}  {cfg[:16]:<16} {msg}"
        )
    return 0


def status(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh status", description="status word of a job (SUCCEEDED, ...)")
    p.add_argument("job_id")
    p.add_argument("-v", "--verbose", action="store_true", help="also print times, message and entrypoint")
    _address_arg(p)
    a = p.parse_args(argv)
    job_id = check_job_id(a.job_id)
    address = resolve_address(a.address)
    client = connect(address)
    info = call_api(client, address, client.get_job_info, job_id, job_id=job_id)
    print(info.status.value)
    if a.verbose:
        print(f"  started:    {_fmt_time(info.start_time)}")
        print(f"  ended:      {_fmt_time(info.end_time)}  (duration {_fmt_duration(info.start_time, info.end_time)})")
        print(f"  message:    {(info.message or '').strip()}")
        print(f"  entrypoint: {info.entrypoint}")
    return 0


def logs(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh logs", description="a job's driver output")
    p.add_argument("job_id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    _address_arg(p)
    a = p.parse_args(argv)
    job_id = check_job_id(a.job_id)
    address = resolve_address(a.address)
    client = connect(address)
    if not a.follow:
        sys.stdout.write(call_api(client, address, client.get_job_logs, job_id, job_id=job_id) or "")
        sys.stdout.flush()
        return 0
    call_api(client, address, client.get_job_status, job_id, job_id=job_id)  # exists?
    import asyncio

    async def _tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    with api_errors(address, getattr(client, "_pretrain_auth_source", ""), job_id=job_id):
        try:
            asyncio.run(_tail())
        except Exception as e:  # noqa: BLE001 - aiohttp errors: map the common ones
            if type(e).__name__ in ("ClientConnectorError", "ServerDisconnectedError", "WSServerHandshakeError"):
                raise ClusterError(f"lost the log stream from {address}: {type(e).__name__}") from None
            raise
    return 0


def stop(argv: list[str]) -> int:
    p = ArgumentParser(prog="launch.sh stop", description="stop a running job")
    p.add_argument("job_id")
    p.add_argument(
        "--wait",
        type=seconds,
        default=None,
        help="seconds to wait for the job to end (default: the time its stop may take, checkpoint.stop_timeout_s "
        "plus a margin, as the job was submitted with; else 60)",
    )
    _address_arg(p)
    a = p.parse_args(argv)
    job_id = check_job_id(a.job_id)
    address = resolve_address(a.address)
    client = connect(address)
    info = call_api(client, address, client.get_job_info, job_id, job_id=job_id)
    current = str(info.status.value)
    if current in TERMINAL:
        print(f"job {job_id} already ended: {current}")
        return 0
    # (a few seconds past Ray's own deadline by default: a driver still running then is killed, and this says so)
    wait = a.wait if a.wait is not None else float((info.metadata or {}).get(STOP_WAIT_KEY, 60)) + STOP_GRACE_S
    print(f"job {job_id}: stopping (the run commits a checkpoint at its current step; waiting up to {wait:.0f} s)")
    call_api(client, address, client.stop_job, job_id, job_id=job_id)
    deadline = time.time() + wait
    while True:
        current = str(call_api(client, address, client.get_job_status, job_id, job_id=job_id).value)
        if current in TERMINAL or time.time() >= deadline:
            break
        time.sleep(0.5)
    if current in TERMINAL:
        late = time.time() > deadline - STOP_GRACE_S and a.wait is None
        killed = " (at Ray's deadline: killed, maybe before its checkpoint)" if late else ""
        print(f"job {job_id}: {current}{killed}")
        return 0
    print(f"job {job_id}: stop requested, still {current} after {wait:.0f} s")
    return 1


STOP_GRACE_S = 5
"""Seconds ``stop`` waits past the job's stop deadline (Ray kills a driver still running then)."""


def stop_running(address: str) -> None:
    """Stop the head's running jobs as ``./launch.sh stop`` does (each run commits a checkpoint at its step and ends
    KILLED), before the head's processes are signalled: killed with the head, a job's driver has no time to save and
    its MLflow run stays RUNNING. Best effort: a head whose Jobs API does not answer is stopped all the same."""
    try:
        client = connect(address)
        running = [
            j.submission_id for j in call_api(client, address, client.list_jobs) if str(j.status.value) not in TERMINAL
        ]
    except ClusterError as e:
        print(f"[cluster] could not list the head's jobs ({e}); stopping it anyway", flush=True)
        return
    if running:
        print(f"[cluster] stopping {len(running)} running job(s) first: each commits a checkpoint", flush=True)
    for job_id in running:
        if job_id:
            try:
                stop([job_id, "--address", address])
            except ClusterError as e:
                print(f"[cluster] job {job_id}: {e}", flush=True)
