"""How the cluster commands reach a Ray head's Jobs API (``submit``, ``status``, ``logs``, ``stop``, ``list``): the
address, the token and the client.

Address: ``--address``, else ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS``, else the local head recorded by
``cluster up``, else http://127.0.0.1:8265. Token (sent as ``Authorization: Bearer``; never printed):
``RAY_AUTH_TOKEN``, else the file in ``RAY_AUTH_TOKEN_PATH``, else the local head's token file (only for
the local head's own address), else ``~/.ray/auth_token``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cluster.head import ClusterError, ClusterUsageError, is_alive, read_state, read_token
from pretrain import invocation

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")


def resolve_address(explicit: str | None = None) -> str:
    address = (explicit or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or "").strip()
    if not address:
        state = read_state()
        address = state["address"] if state else DEFAULT_ADDRESS
    if address == "auto" or address.startswith("ray://"):
        raise ClusterUsageError(
            f"{address}: not a Jobs API address; pass --address http://HEAD:8265 (the dashboard port)"
        )
    if "://" not in address:
        address = "http://" + address
    return address.rstrip("/")


def _endpoint(address: str) -> tuple[str, int]:
    try:  # urlsplit refuses some addresses itself (an unclosed IPv6 bracket), .port a port that is not one
        parts = urlsplit(address)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ClusterUsageError(f"{address}: invalid address") from None
    if not host:
        raise ClusterUsageError(f"{address}: invalid address")
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
        raise ClusterUsageError(f"{job_id!r}: not a job id")
    return job_id
