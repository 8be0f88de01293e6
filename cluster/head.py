"""A local Ray head on 127.0.0.1 for trying out job submission (``./launch.sh cluster up|down|status``).

* Bound to loopback only: ``ray start --head --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1``
  with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (otherwise Ray on Linux swaps 127.0.0.1 for the routable
  IP and binds its gRPC servers on all interfaces).
* Token authentication on: ``RAY_AUTH_MODE=token`` with ``RAY_AUTH_TOKEN_PATH`` pointing at a token file
  in the state directory (``.cache/ray-head/auth_token``, mode 600; the user's ``~/.ray`` is not touched).
  Every HTTP request to the dashboard / Jobs API and every gRPC call needs that token.
* Its own temp dir (``/tmp/pretrain-ray-<uid>-<hash of the state directory>``: :func:`default_temp_dir`).
* ``ray start`` runs as the leader of a new session, so every Ray process of this head shares that
  session id; ``down`` stops exactly those processes (plus their descendants, e.g. job drivers, and
  anything whose cwd is under the head's temp dir). It never runs ``ray stop``, which would stop every
  Ray on the machine.
* The state (address, ports, session id, temp dir, token path) is recorded in ``state.json`` in the state
  directory (``.cache/ray-head``; ``PRETRAIN_RAY_HEAD_DIR`` overrides it; :mod:`cluster.head_state`). A restart
  of the machine or container since the head started means none of its processes is alive: ``down`` ends nothing
  then (the recorded session id may be another process's by now).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cluster.head_procs import head_processes, restart_mark, restarted_since, session_of, terminate
from cluster.head_state import (  # noqa: F401 - ClusterError, read_state, read_token, state_dir: re-exported
    ROOT,
    ClusterError,
    ClusterUsageError,
    claim_temp_dir,
    clear_state,
    locked,
    new_token,
    read_state,
    read_token,
    state_dir,
    write_state,
)
from cluster.requires import require_ray
from pretrain import invocation
from pretrain.config.errors import ArgumentParser, without_passwords
from pretrain.ports import free_port, port_free

DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_GCS_PORT = 6379
# Ray's default worker port range: other fixed ports must stay out of it.
_WORKER_PORTS = range(10002, 20000)


# ------------------------------------------------------------------------------------------------
# Network helpers
# ------------------------------------------------------------------------------------------------


def _free_port(avoid: set[int]) -> int:
    try:
        return free_port(avoid | set(_WORKER_PORTS))
    except OSError as e:
        raise ClusterError(str(e)) from None


def dashboard_get(address: str, path: str, token: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``address + path`` with the bearer token; (status, body), status 0 when unreachable."""
    req = urllib.request.Request(address.rstrip("/") + path)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def _ray_bin() -> str:
    cand = Path(sys.executable).with_name("ray")
    return str(cand) if cand.exists() else "ray"


def default_temp_dir() -> str:
    """``/tmp/pretrain-ray-<uid>-<8 hex digits of the state directory>``: short (Unix socket paths must stay under 107
    characters), and one per state directory, so that two heads of one user (two checkouts, or
    ``PRETRAIN_RAY_HEAD_DIR``) never share one: ``down`` ends the processes working in its head's temp dir."""
    digest = hashlib.sha256(str(state_dir()).encode()).hexdigest()[:8]
    return f"/tmp/pretrain-ray-{os.getuid()}-{digest}"


# ------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------


def is_alive(state: dict[str, Any]) -> bool:
    pid = int(state.get("gcs_pid", 0))
    if pid <= 0:
        return False
    try:
        import psutil

        p = psutil.Process(pid)
        alive = p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        return alive and session_of(pid) == state.get("sid") and not restarted_since(state)
    except Exception:  # noqa: BLE001 - gone, or not ours
        return False


def up(args: argparse.Namespace) -> int:
    with locked("up"):
        return _up(args)


def _up(args: argparse.Namespace) -> int:
    state = read_state()
    if state and is_alive(state):
        print(f"Ray head already running at {state['address']} ({invocation.command()} cluster down to stop it)")
        return 0
    recorded = str((state or {}).get("temp_dir", ""))  # an earlier head's temp dir here: its own, marked or not
    if state:  # stale: a head that died; clean up leftovers of it
        terminate(head_processes(state), grace_s=3)
        clear_state()

    temp_dir = str(Path(args.temp_dir).expanduser().absolute()) if args.temp_dir else default_temp_dir()
    if len(temp_dir) > 60:
        raise ClusterUsageError(f"--temp-dir {temp_dir}: too long (Ray's Unix socket paths must stay under 107 chars)")
    dash = args.dashboard_port
    if not port_free(dash):
        raise ClusterError(f"port {dash} on 127.0.0.1 is in use (another Ray dashboard?); pass --dashboard-port N")
    taken = {dash}
    gcs = args.port or (DEFAULT_GCS_PORT if port_free(DEFAULT_GCS_PORT) else _free_port(taken))
    if not port_free(gcs):
        raise ClusterError(f"port {gcs} on 127.0.0.1 is in use; pass --port N")
    taken.add(gcs)
    client_port = _free_port(taken)
    taken.add(client_port)
    agent_port = _free_port(taken)
    taken.add(agent_port)
    for name, port in (("--dashboard-port", dash), ("--port", gcs)):
        if port in _WORKER_PORTS:
            raise ClusterUsageError(f"{name} {port}: inside Ray's worker port range 10002-19999; pick another port")

    claim_temp_dir(Path(temp_dir), given=bool(args.temp_dir), recorded=recorded)
    tok = new_token()
    sdir = state_dir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_API_SERVER_ADDRESS")}
    env.update(
        {
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(tok),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
    )
    cmd = [
        _ray_bin(),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--port",
        str(gcs),
        "--dashboard-port",
        str(dash),
        "--ray-client-server-port",
        str(client_port),
        "--dashboard-agent-listen-port",
        str(agent_port),
        "--temp-dir",
        temp_dir,
        "--num-cpus",
        str(args.num_cpus or os.cpu_count() or 1),
        "--disable-usage-stats",
    ]
    if args.num_gpus is not None:
        cmd += ["--num-gpus", str(args.num_gpus)]
    log_path = sdir / "ray-start.log"
    started_at = time.time()
    print(f"[cluster] starting a local Ray head on 127.0.0.1 (temp dir {temp_dir}) ...", flush=True)
    with open(log_path, "w") as log:
        # A new session: every process of this head inherits its id, which is how `down` finds them.
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(ROOT),
        )
    state = {
        "address": f"http://127.0.0.1:{dash}",
        "gcs_address": f"127.0.0.1:{gcs}",
        "sid": proc.pid,
        "started_at": started_at,
        "restart_mark": restart_mark(),  # a later restart of the machine or container: nothing of it is alive
        "temp_dir": temp_dir,
        "token_path": str(tok),
        "dashboard_port": dash,
        "gcs_port": gcs,
        "client_server_port": client_port,
        "dashboard_agent_port": agent_port,
        "python": sys.executable,
        "log": str(log_path),
        "num_cpus": args.num_cpus or os.cpu_count() or 1,  # what it offers: submit refuses a layout beyond it
        "num_gpus": args.num_gpus,  # None: Ray's detection (this machine's GPUs)
    }
    write_state(state)  # recorded first, so `down` can clean up even a half-started head
    # `ray start` runs in its own session, which Ctrl-C does not reach: a stop (or a failure) while the head starts
    # ends what it started, rather than leave a head that runs with no record of its GCS.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _wait_until_up(proc, state, tok, log_path)
    except BaseException:
        terminate(head_processes(state), grace_s=3)
        clear_state()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"Ray head up: {state['address']}  (Jobs API and dashboard; GCS {state['gcs_address']}; 127.0.0.1 only)")
    print(f"  token authentication: on (token in {_display(tok)}, mode 600; clients here pick it up)")
    print(f"  submit:  {invocation.command()} submit [CONFIG] [key=value ...]")
    print(f"  stop:    {invocation.command()} cluster down")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: the Python stack unwinds (and cleans up) instead of ending at once."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _wait_until_up(proc: subprocess.Popen, state: dict[str, Any], tok: Path, log_path: Path) -> None:
    """Wait for ``ray start`` to end and the dashboard to answer; record the GCS server's pid in the state.
    Raises :class:`ClusterError` when either fails (the caller ends what was started)."""
    try:
        rc = proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        rc = None
    if rc != 0:
        raise ClusterError(f"ray start failed ({_last_error_line(log_path)}); full log: {log_path}")
    state["gcs_pid"] = _find_gcs_pid(state)
    write_state(state)
    claim_temp_dir(Path(state["temp_dir"]), given=False)  # again: `ray start` makes its temp dir world-writable
    token = read_token(tok)
    deadline = time.time() + 60
    status = 0
    while time.time() < deadline:
        status, _ = dashboard_get(state["address"], "/api/version", token)
        if status == 200:
            break
        time.sleep(0.5)
    if status != 200:
        raise ClusterError(f"the Ray dashboard did not come up at {state['address']} (HTTP {status}); log: {log_path}")


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _last_error_line(log_path: Path) -> str:
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def _find_gcs_pid(state: dict[str, Any]) -> int:
    for p in head_processes(state):
        try:
            if p.name() == "gcs_server":
                return p.pid
        except Exception:  # noqa: BLE001
            continue
    return 0


def down(args: argparse.Namespace, stop_jobs: Callable[[str], None] | None = None) -> int:
    """Stop the head recorded here; ``stop_jobs(address)`` first, while it is alive (the CLI passes
    :func:`cluster.jobs.stop_running`: its jobs commit a checkpoint, as ``stop`` has them do)."""
    with locked("down"):
        return _down(args, stop_jobs)


def _down(args: argparse.Namespace, stop_jobs: Callable[[str], None] | None) -> int:
    state = read_state()
    if not state:
        print("no local Ray head recorded (nothing to stop)")
        return 0
    if stop_jobs is not None and is_alive(state):
        stop_jobs(state["address"])
    procs = head_processes(state)
    n = terminate(procs, grace_s=args.grace)
    clear_state()
    print(
        f"Ray head at {state.get('address')} stopped ({n} processes)"
        if n
        else f"Ray head at {state.get('address')} was not running; state cleared"
    )
    return 0


def status(args: argparse.Namespace) -> int:
    state = read_state()
    if not state:
        print(f"no local Ray head recorded ({invocation.command()} cluster up starts one)")
        return 1
    address = state["address"]
    alive = is_alive(state)
    token = read_token(state.get("token_path", ""))
    code, body = 0, b""
    deadline = time.time() + 15
    while alive:  # the autoscaler's first report comes a few seconds after start
        code, body = dashboard_get(address, "/api/cluster_status", token)
        if code != 200 or _usage(body) or time.time() > deadline:
            break
        time.sleep(1)
    print(f"address:   {address}  (GCS {state.get('gcs_address')}, temp dir {state.get('temp_dir')})")
    if not alive:
        cmd = invocation.command()
        print(f"state:     dead ({cmd} cluster down clears it; {cmd} cluster up starts a new one)")
        return 1
    if code != 200:
        print(f"state:     alive, but the dashboard answered HTTP {code or 'nothing'}")
        return 1
    print("state:     alive (token authentication on)")
    try:
        data = json.loads(body)["data"]["clusterStatus"]
        report = data.get("loadMetricsReport") or {}
        usage = report.get("usage") or {}
        nodes = sum((data.get("autoscalerReport") or {}).get("activeNodes", {}).values())
        parts = []
        for key, label, scale in (
            ("CPU", "CPU", 1),
            ("GPU", "GPU", 1),
            ("memory", "GiB memory", 2**30),
            ("objectStoreMemory", "GiB object store", 2**30),
        ):
            if key in usage:
                used, total = usage[key]
                fmt = "{:.1f}" if scale > 1 else "{:g}"
                parts.append(f"{fmt.format(used / scale)}/{fmt.format(total / scale)} {label}")
        print(f"nodes:     {nodes}")
        print(f"resources: {', '.join(parts)} in use")
    except (KeyError, ValueError, TypeError):
        print("resources: (not reported yet)")
    return 0


def _usage(body: bytes) -> dict:
    try:
        return json.loads(body)["data"]["clusterStatus"]["loadMetricsReport"]["usage"] or {}
    except (KeyError, ValueError, TypeError):
        return {}


def main(argv: list[str], stop_jobs: Callable[[str], None] | None = None) -> int:
    """``cluster up|down|status``; ``stop_jobs``: see :func:`down`."""
    p = ArgumentParser(prog="launch.sh cluster", description="a local Ray head on 127.0.0.1")
    sub = p.add_subparsers(dest="action", required=True)
    pu = sub.add_parser("up", help="start a local Ray head (127.0.0.1, token auth)")
    pu.add_argument(
        "--dashboard-port", type=_port, default=DEFAULT_DASHBOARD_PORT, help="Jobs API / dashboard port (default 8265)"
    )
    pu.add_argument("--port", type=_port, default=0, help="GCS port (default 6379, or a free one if taken)")
    pu.add_argument(
        "--temp-dir", default="", help="Ray temp dir (default /tmp/pretrain-ray-UID-HASH, one per state directory)"
    )
    pu.add_argument("--num-cpus", type=int, default=0, help="CPUs to offer (default: all)")
    pu.add_argument("--num-gpus", type=int, default=None, help="GPUs to offer (default: detected)")
    pd = sub.add_parser("down", help="stop the local head started by `cluster up` (only its processes)")
    pd.add_argument("--grace", type=seconds, default=5.0, help="seconds between SIGTERM and SIGKILL")
    sub.add_parser("status", help="address, alive/dead, resources")
    a = p.parse_args(argv)
    if a.action == "down":
        return down(a, stop_jobs)
    return {"up": up, "status": status}[a.action](a)


def _port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: a port is 1-65535")
    return port


def seconds(text: str) -> float:
    """An argparse ``type`` of a duration in seconds: a number >= 0 (not NaN)."""
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text}: seconds must be >= 0")
    return value


def run_cli(fn, argv: list[str], command: str) -> int:
    """Run the cluster command ``command``: a ClusterError (unreachable, authentication, unknown job...) is one
    line on stderr and exit code 1 (a bad argument, :class:`ClusterUsageError`: 2); config errors, and Ray not
    installed (:func:`cluster.requires.require_ray`), propagate to the CLI (exit 2). Its ``--help`` needs no Ray."""
    if not {"-h", "--help"} & set(argv):
        require_ray(f"{invocation.command()} {command}")
    try:
        return fn(argv)
    except ClusterError as e:  # an address may hold a password (http://user:PASSWORD@head:8265): never printed
        print(f"error: {without_passwords(str(e))}", file=sys.stderr)
        return 2 if isinstance(e, ClusterUsageError) else 1
