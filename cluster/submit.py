"""Ray Jobs API client: ``./launch.sh submit`` (watching and stopping jobs: :mod:`cluster.jobs`).

``submit`` validates the config locally (``load_config``: a bad config exits 2 and nothing is sent),
writes the resolved YAML next to the project code and sends both as the job's ``working_dir``; the
entrypoint is ``PYTHON -m pretrain train _pretrain_job.yaml`` (cwd = the unpacked working dir). Inside
the job ``RAY_ADDRESS`` is set, so ``cluster/launch.py`` connects to that cluster.

The working dir is the repo root as seen through a staging directory of symlinks (so the one extra
file, the config, travels with the code without writing into the checkout), with ``.venv``, ``.git``,
checkpoints, MLflow stores and caches excluded. Environment variables reach the job only through an
explicit allowlist (``JOB_ENV`` plus ``--env NAME``); none are printed.

For the head of ``cluster up`` (same machine) relative paths in the config are resolved against the cwd
here, the job runs with the head's Python and logs to this machine's MLflow store (``MLFLOW_TRACKING_URI``
or ./mlflow.db), exactly like ``./launch.sh train``. For any other address the config travels as given:
paths must be valid on the cluster (a shared ``checkpoint.dir``), ``python`` is the cluster's.

Address: ``--address``, else ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS``, else the local head recorded by
``cluster up``, else http://127.0.0.1:8265. Token (sent as ``Authorization: Bearer``; never printed):
``RAY_AUTH_TOKEN``, else the file in ``RAY_AUTH_TOKEN_PATH``, else the local head's token file (only for
the local head's own address), else ``~/.ray/auth_token``.
"""

from __future__ import annotations

import argparse
import fnmatch
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cluster.head import ClusterError, is_alive, read_state, read_token
from pretrain import invocation
from pretrain.config.errors import without_passwords

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
JOB_CONFIG_NAME = "_pretrain_job.yaml"
# Never uploaded (top level of the repo, and the same names at any depth via runtime_env excludes).
EXCLUDES = [
    ".venv",
    ".git",
    "checkpoints",
    "mlflow.db",
    "mlartifacts",
    "mlruns",
    ".cache",
    "exported",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    "runs",
    ".mypy_cache",
    ".ruff_cache",
]
SECRETS = [".env", ".env.*", ".netrc", ".pypirc", "*.pem", "*.key", "*.p12", "id_rsa*", "id_ed25519*"]
"""Files that hold credentials: never uploaded with the job's code, at any depth."""
NETWORK_ENV = (
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_IB_HCA",
    "NCCL_IB_GID_INDEX",
    "NCCL_NET_GDR_LEVEL",
    "GLOO_SOCKET_IFNAME",
)
"""How the collectives find their network: forwarded to a submitted job and by a job to its Ray workers."""
# Environment variables forwarded to the job when set on the submitting machine (values never printed).
JOB_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "MLFLOW_DISABLE_TELEMETRY",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TOKENIZERS_PARALLELISM",
    "DS_ACCELERATOR",
    "DS_BUILD_OPS",
    "PYTORCH_CUDA_ALLOC_CONF",
    *NETWORK_ENV,
)
# Forwarded only to a head on this machine (they name local paths).
LOCAL_JOB_ENV = ("TORCH_EXTENSIONS_DIR",)
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
STOP_MARGIN_S = 30
"""Seconds Ray Jobs waits after ``checkpoint.stop_timeout_s`` before it kills a stopping job's driver."""
STOP_WAIT_KEY = "stop_wait_s"
"""The job's metadata key of the seconds its stop may take (``stop`` waits that long by default)."""
_RUN_RE = re.compile(r"\[pretrain\] (?:resuming )?run ((?:local-)?[0-9a-f]{8,})")  # local-: tracking.enabled=false
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


# ------------------------------------------------------------------------------------------------
# Address, token, client
# ------------------------------------------------------------------------------------------------


def resolve_address(explicit: str | None = None) -> str:
    address = (explicit or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or "").strip()
    if not address:
        state = read_state()
        address = state["address"] if state else DEFAULT_ADDRESS
    if address == "auto" or address.startswith("ray://"):
        raise ClusterError(f"{address}: not a Jobs API address; pass --address http://HEAD:8265 (the dashboard port)")
    if "://" not in address:
        address = "http://" + address
    return address.rstrip("/")


def _endpoint(address: str) -> tuple[str, int]:
    try:  # urlsplit refuses some addresses itself (an unclosed IPv6 bracket), .port a port that is not one
        parts = urlsplit(address)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ClusterError(f"{address}: invalid address") from None
    if not host:
        raise ClusterError(f"{address}: invalid address")
    return host, port


def local_head(address: str) -> dict[str, Any] | None:
    """The state of the head started here by ``cluster up`` when ``address`` is that head and it is alive (same
    machine, same filesystem: paths are resolved against the cwd here, and its Python runs the job). A head that
    died is not it: whatever answers on its port now gets neither its token nor the local-only environment."""
    state = _live_head()
    return state if state and state.get("address") and _same_endpoint(address, state["address"]) else None


def _live_head() -> dict[str, Any] | None:
    """The recorded state of ``cluster up``'s head while that head runs, else None."""
    state = read_state()
    return state if state and is_alive(state) else None


def _same_endpoint(a: str, b: str) -> bool:
    ha, pa = _endpoint(a)
    hb, pb = _endpoint(b)
    loop = ("127.0.0.1", "localhost", "::1")
    return pa == pb and (ha == hb or (ha in loop and hb in loop))


def auth_token(address: str) -> tuple[str, str]:
    """(token, where it came from); ("", "") when none is available. The live local head's own token for its
    address (the one it accepts, whatever ``RAY_AUTH_TOKEN`` says for other clusters), else ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``."""
    state = _live_head()
    if state and state.get("token_path") and _same_endpoint(address, state["address"]):
        tok = read_token(state["token_path"])
        if tok:
            return tok, "the local head's token file"
    tok = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if tok:
        return tok, "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip()
    if path:
        tok = read_token(path)
        if not tok:
            raise ClusterError(f"RAY_AUTH_TOKEN_PATH={path}: file missing or empty")
        return tok, "RAY_AUTH_TOKEN_PATH"
    default = Path.home() / ".ray" / "auth_token"
    tok = read_token(default) if default.is_file() else ""
    return (tok, "~/.ray/auth_token") if tok else ("", "")


def _auth_failed(address: str, source: str, rejected: bool) -> ClusterError:
    if rejected:
        return ClusterError(f"authentication failed at {address}: the cluster rejected the token from {source}")
    return ClusterError(
        f"authentication failed at {address}: the cluster requires a token and none was found "
        "(set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)"
    )


@contextmanager
def api_errors(address: str, source: str, job_id: str = "") -> Iterator[None]:
    """Turn Ray / HTTP failures into one-line ClusterErrors."""
    import requests
    from ray.exceptions import AuthenticationError

    try:
        yield
    except ClusterError:
        raise
    except AuthenticationError as e:
        raise _auth_failed(address, source, rejected="Authentication required" not in str(e)) from None
    except (ConnectionError, requests.exceptions.ConnectionError, requests.exceptions.Timeout):
        raise ClusterError(f"cannot reach the Ray Jobs API at {address} (connection failed)") from None
    except RuntimeError as e:
        text = str(e)
        if job_id and ("404" in text or "does not exist" in text):
            raise ClusterError(f"no job {job_id} at {address}") from None
        if "status code 401" in text or "status code 403" in text:
            raise _auth_failed(address, source, rejected="403" in text) from None
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        reason = lines[0] if len(lines) < 2 or "Traceback" not in lines[0] else f"{lines[0]} ... {lines[-1]}"
        raise ClusterError(f"Ray Jobs API at {address}: {reason[:300]}") from None


def connect(address: str):
    """A JobSubmissionClient for ``address`` (reachability and token checked)."""
    host, port = _endpoint(address)
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ClusterError(
            f"cannot reach the Ray Jobs API at {address} ({reason}); start a local head with "
            f"{invocation.command()} cluster up, or pass --address http://HEAD:8265"
        ) from None
    token, source = auth_token(address)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    from ray.job_submission import JobSubmissionClient

    # No INFO chatter about packaging/uploads (these loggers set INFO explicitly).
    for name in (
        "ray",
        "ray.dashboard.modules.dashboard_sdk",
        "ray.dashboard.modules.job.sdk",
        "ray._private.runtime_env.packaging",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)

    with api_errors(address, source), _without_ray_address_env():
        client = JobSubmissionClient(address, headers=headers)
    client._pretrain_auth_source = source  # type: ignore[attr-defined]  # ours, for error messages of later calls
    return client


@contextmanager
def _without_ray_address_env() -> Iterator[None]:
    """Ray's client takes ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS`` over the address it is given; while it is made,
    neither is set, so that it talks to ``address`` (:func:`resolve_address` already put ``--address`` first)."""
    saved = {k: os.environ.pop(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def call_api(client, address: str, fn, *args, job_id: str = ""):
    with api_errors(address, getattr(client, "_pretrain_auth_source", ""), job_id=job_id):
        return fn(*args)


def check_job_id(job_id: str) -> str:
    if not _JOB_ID_RE.match(job_id):
        raise ClusterError(f"{job_id!r}: not a job id")
    return job_id


# ------------------------------------------------------------------------------------------------
# submit
# ------------------------------------------------------------------------------------------------


def upload_excludes(cfg) -> list[str]:
    """What the job's upload leaves out (patterns as in ``.gitignore``, relative to the checkout): :data:`EXCLUDES`,
    :data:`SECRETS`, and the run's checkpoint and cache directories where they lie inside the checkout (any name:
    earlier runs' checkpoints would otherwise travel with every job), and wheelhouses made in the checkout
    (``./launch.sh wheelhouse wheels/``: hundreds of MiB no job reads)."""
    out = [*EXCLUDES, *SECRETS]
    for d in (cfg.checkpoint.dir, cfg.data.cache_dir):
        path = (Path.cwd() / d).resolve()  # relative: where the runs of this shell wrote it
        if path != ROOT and path.is_relative_to(ROOT):
            out.append("/" + path.relative_to(ROOT).as_posix())
    out += [f"/{d.name}" for d in sorted(ROOT.iterdir()) if d.is_dir() and (d / "wheelhouse.json").is_file()]
    return out


def _stage_working_dir(config_yaml: str, excludes: list[str] = EXCLUDES) -> Path:
    """A temp dir mirroring the repo root (symlinks; Ray's packer follows them) plus the job config; top-level
    entries that ``excludes`` names are left out (the upload applies the other patterns)."""
    stage = Path(tempfile.mkdtemp(prefix="pretrain-submit-"))
    top = [e.lstrip("/") for e in excludes if "/" not in e.lstrip("/")]
    for entry in ROOT.iterdir():
        if entry.name == JOB_CONFIG_NAME or any(fnmatch.fnmatch(entry.name, e) for e in top):
            continue
        (stage / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (stage / JOB_CONFIG_NAME).write_text(config_yaml)
    return stage


def job_env(local: bool, extra: list[str], gcs_address: str = "") -> dict[str, str]:
    env = {k: os.environ[k] for k in JOB_ENV if os.environ.get(k)}
    # The commands the job prints (its logs) start as the user starts them in this shell.
    env[invocation.LAUNCHER_ENV] = invocation.command()
    if local:  # paths as this shell resolves them (the job runs in Ray's copy of the code, elsewhere)
        from pretrain.train.tracking import tracking_uri

        env.update({k: str(Path(os.environ[k]).resolve()) for k in LOCAL_JOB_ENV if os.environ.get(k)})
        env["MLFLOW_TRACKING_URI"] = tracking_uri()  # the store `./launch.sh runs` reads here (a relative one too)
        if gcs_address:
            # Ray-internal actors (Train's placement-group cleaner uses the State API) find their cluster
            # by RAY_ADDRESS; without it they guess, and fail when this machine runs several Rays.
            env["RAY_ADDRESS"] = gcs_address
    for item in extra:
        name, eq, value = item.partition("=")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ClusterError(f"--env {name!r}: not an environment variable name")
        if eq:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
        else:
            raise ClusterError(f"--env {name}: not set in this environment")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    # The driver's own ray.init(runtime_env=...) re-declares some of these keys (same values): allow it.
    env["RAY_OVERRIDE_JOB_RUNTIME_ENV"] = "1"
    return env


def _hint(address: str, explicit: bool) -> str:
    """The ``--address`` of the printed commands (with a password in it shown as ``***``: the shell that has it
    set, e.g. in ``RAY_ADDRESS``, runs them as they are)."""
    return f" --address {without_passwords(address)}" if explicit else ""


def submit(argv: list[str]) -> int:
    from pretrain.config import DEFAULT_CONFIG, dump_yaml, load_config, split_args

    p = argparse.ArgumentParser(prog="launch.sh submit", description="submit a training job to a Ray cluster")
    p.add_argument("--address", default=None, help="Jobs API address, e.g. http://HEAD:8265")
    p.add_argument(
        "--python",
        default=None,
        help="Python on the cluster (default: the local head's interpreter for the head of `cluster up`, "
        "else 'python')",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="also pass this environment variable to the job (repeatable)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=120.0,
        help="seconds to wait for the MLflow run id (0: print the job id and return)",
    )
    p.add_argument("--job-id", default=None, help="submission id to use (default: generated by Ray)")
    a, rest = p.parse_known_args(argv)
    path, overrides = split_args(rest)
    cfg = load_config(path or DEFAULT_CONFIG, overrides)  # ConfigError -> exit 2, nothing sent

    address = resolve_address(a.address)
    explicit = bool(a.address)
    head = local_head(address)
    local = head is not None
    if a.job_id:
        check_job_id(a.job_id)
    client = connect(address)  # unreachable / authentication: one line before anything else
    if head is not None:  # (local)
        from cluster.placement import check_layout, local_gpus
        from pretrain.config.paths import resolve_paths

        if head.get("num_cpus"):  # (a head of an earlier version recorded no resources)
            gpus = local_gpus() if head.get("num_gpus") is None else int(head["num_gpus"])
            check_layout(cfg.cluster, float(head["num_cpus"]), gpus, "the local head offers", "cluster up")
        cfg = resolve_paths(cfg, Path.cwd())  # same filesystem: checkpoints/caches where the user is
    elif not Path(cfg.checkpoint.dir).is_absolute():
        print(
            f"[submit] note: checkpoint.dir={cfg.checkpoint.dir!r} is relative: on the cluster it lands in the "
            "job's temporary working dir; pass checkpoint.dir=/shared/path (see docs/multi-node.md)",
            file=sys.stderr,
        )
    env = job_env(local, a.env, head.get("gcs_address", "") if head else "")
    if not local and "MLFLOW_TRACKING_URI" not in env:
        print(
            "[submit] note: MLFLOW_TRACKING_URI is not set here: the job uses the cluster's own setting",
            file=sys.stderr,
        )
    # Ray Jobs' stop sends SIGTERM, then SIGKILL after this many seconds: room for the stop's checkpoint.
    env.setdefault("RAY_JOB_STOP_WAIT_TIME_S", str(int(cfg.checkpoint.stop_timeout_s) + STOP_MARGIN_S))
    python = a.python or (shlex.quote(head.get("python") or sys.executable) if head else "python")
    entrypoint = f"{python} -m pretrain train {JOB_CONFIG_NAME}"
    excludes = upload_excludes(cfg)
    stage = _stage_working_dir(dump_yaml(cfg), excludes)
    try:
        runtime_env: dict[str, Any] = {"working_dir": str(stage), "excludes": excludes, "env_vars": env}
        job_id = call_api(
            client,
            address,
            lambda: client.submit_job(
                entrypoint=entrypoint,
                runtime_env=runtime_env,
                submission_id=a.job_id,
                metadata={
                    "pretrain_config": cfg.name,
                    "submitted_from": "pretrain submit",
                    STOP_WAIT_KEY: env["RAY_JOB_STOP_WAIT_TIME_S"],
                },
            ),
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    print(f"job id: {job_id}", flush=True)
    hint = _hint(address, explicit)
    rc = 0
    if a.wait > 0:
        rc = _wait_for_run_id(client, address, job_id, a.wait, hint)
    cmd = invocation.command()
    print(f"  logs:    {cmd} logs {job_id} --follow{hint}")
    print(f"  status:  {cmd} status {job_id}{hint}")
    print(f"  stop:    {cmd} stop {job_id}{hint}")
    return rc


def _wait_for_run_id(client, address: str, job_id: str, timeout: float, hint: str) -> int:
    deadline = time.time() + timeout
    while True:
        logs = call_api(client, address, client.get_job_logs, job_id, job_id=job_id)
        m = _RUN_RE.search(logs or "")
        if m:
            print(f"MLflow run id: {m.group(1)}", flush=True)
            return 0
        status = str(call_api(client, address, client.get_job_status, job_id, job_id=job_id).value)
        if status in TERMINAL:
            # Lines the CLI prints for user errors start with "error: "; else Ray's job message.
            errs = [ln for ln in (logs or "").splitlines() if ln.startswith("error: ")]
            if errs:
                why = errs[-1][len("error: ") :]
            else:
                info = call_api(client, address, client.get_job_info, job_id, job_id=job_id)
                why = (info.message or "").strip().splitlines()[0] if info.message else "no details"
            print(
                f"error: job {job_id} {status} before it started a run: {why[:300]} "
                f"({invocation.command()} logs {job_id}{hint})",
                file=sys.stderr,
            )
            return 1
        if time.time() >= deadline:
            print(
                f"MLflow run id: not known yet after {timeout:.0f} s (job {status}; "
                f"{invocation.command()} logs {job_id}{hint} shows it once the run starts)",
                flush=True,
            )
            return 0
        time.sleep(1.0)
