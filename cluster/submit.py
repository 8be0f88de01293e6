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

The address, the token and the client: :mod:`cluster.connection`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster.connection import (  # noqa: F401 - resolve_address, auth_token, local_head: re-exported
    DEFAULT_ADDRESS,
    auth_token,
    call_api,
    check_job_id,
    connect,
    local_head,
    resolve_address,
)
from cluster.head import ClusterUsageError, seconds
from pretrain import invocation
from pretrain.config.errors import ArgumentParser, without_passwords

ROOT = Path(__file__).resolve().parents[1]
JOB_CONFIG_NAME = "_pretrain_job.yaml"
# Never uploaded (top level of the repo, and the same names at any depth via runtime_env excludes).
EXCLUDES = [
    ".venv",
    ".venv-*",
    "venv",
    ".tox",
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
SECRETS = [
    ".env",
    ".env.*",
    ".envrc",
    ".netrc",
    ".pypirc",
    ".git-credentials",
    ".aws",
    ".ssh",
    "credentials.json",
    "*.pem",
    "*.key",
    "*.p12",
    "id_rsa*",
    "id_ed25519*",
]
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
    entries that ``excludes`` names are left out (the upload applies the other patterns), and so are top-level
    links out of the checkout (``data -> /mnt/corpus``: Ray's packer would upload what they point at), each said."""
    stage = Path(tempfile.mkdtemp(prefix="pretrain-submit-"))
    top = [e.lstrip("/") for e in excludes if "/" not in e.lstrip("/")]
    for entry in sorted(ROOT.iterdir()):
        if entry.name == JOB_CONFIG_NAME or any(fnmatch.fnmatch(entry.name, e) for e in top):
            continue
        if entry.is_symlink() and not entry.resolve().is_relative_to(ROOT):
            print(
                f"[submit] not uploaded: {entry.name} (a link to {entry.resolve()}, outside the checkout; a job "
                f"reads such data where the cluster sees it)",
                file=sys.stderr,
            )
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
            raise ClusterUsageError(f"--env {_shown(name)}: not an environment variable name")
        if eq:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
        else:
            raise ClusterUsageError(
                f"--env {_shown(name)}: not set in this environment (--env takes a NAME or NAME=VALUE)"
            )
    wait = env.get("RAY_JOB_STOP_WAIT_TIME_S")
    if wait is not None and not re.match(r"^[0-9]+$", wait):  # Ray's supervisor reads it with int()
        raise ClusterUsageError(f"--env RAY_JOB_STOP_WAIT_TIME_S={wait}: not a whole number of seconds")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    # The driver's own ray.init(runtime_env=...) re-declares some of these keys (same values): allow it.
    env["RAY_OVERRIDE_JOB_RUNTIME_ENV"] = "1"
    return env


def _shown(name: str) -> str:
    """An ``--env`` argument as an error shows it: a conventional variable name (capitals, digits, ``_``) whole;
    anything else, perhaps a value passed by mistake (``--env "$HF_TOKEN"``), by its first 3 characters."""
    if re.match(r"^[A-Z_][A-Z0-9_]*$", name):
        return name
    return f"{name[:3]!r}... ({len(name)} characters; not shown)"


def _hint(address: str, explicit: bool) -> str:
    """The ``--address`` of the printed commands (with a password in it shown as ``***``: the shell that has it
    set, e.g. in ``RAY_ADDRESS``, runs them as they are)."""
    return f" --address {without_passwords(address)}" if explicit else ""


def submit(argv: list[str]) -> int:
    from pretrain.config import DEFAULT_CONFIG, dump_yaml, load_config, split_args

    p = ArgumentParser(prog="launch.sh submit", description="submit a training job to a Ray cluster")
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
        type=seconds,
        default=120.0,
        help="seconds to wait for the MLflow run id (0: print the job id and return)",
    )
    p.add_argument("--job-id", default=None, help="submission id to use (default: generated by Ray)")
    p.add_argument(
        "args",
        nargs="*",
        metavar="CONFIG|key=value",
        help="a config file (default configs/demo-decoder.yaml), then key=value overrides, as train takes them",
    )
    a = p.parse_intermixed_args(argv)  # a mistyped option (--adress) is refused by name, not read as a config
    path, overrides = split_args(a.args)
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
