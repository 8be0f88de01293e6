"""Links into the MLflow UI that open on model training, and ``./launch.sh ui --open``.

MLflow 3's UI takes its chrome (GenAI overview and traces, or the Runs table, models and the model registry) from a
setting stored in the browser (``mlflow.workflowType``, GenAI unless the user switched), not from the experiment's
``mlflow.experimentKind`` tag; the URL parameter ``workflowType=machine_learning`` overrides that setting and the UI
keeps it on the links it renders. Every link the commands print is built by :func:`ui_url`.
"""

from __future__ import annotations

import os
import socket
import time
import webbrowser
from urllib.parse import urlsplit, urlunsplit

WORKFLOW = "workflowType=machine_learning"
"""The query that opens a page of the UI as model training (the UI's values: ``genai``, ``machine_learning``)."""
DEFAULT_UI = "http://127.0.0.1:5000"
"""Where ``./launch.sh ui`` serves a local tracking store by default."""


def ui_url(base: str, experiment_id: str | None = None, run_id: str | None = None, tab: str = "") -> str:
    """The page of the UI at ``base`` (``http://HOST:PORT``, or a tracking server's URL with its path): the list of
    experiments, an experiment's runs, or a run (``tab``: one of its tabs, e.g. ``model-metrics``), always opened
    as model training (:data:`WORKFLOW`)."""
    if run_id is not None and experiment_id is None:
        raise ValueError("a run's page needs its experiment id")
    page = "#/experiments"
    if experiment_id is not None:
        page += f"/{experiment_id}"
        if run_id is not None:
            page += f"/runs/{run_id}" + (f"/{tab}" if tab else "")
    return f"{base.rstrip('/')}/{page}?{WORKFLOW}"


def ui_base(uri: str) -> str:
    """The UI that shows the tracking store ``uri``: a tracking server (``http(s)://``) serves its own (its URL
    without credentials or query); any other store is shown by ``./launch.sh ui`` at :data:`DEFAULT_UI`."""
    if not uri.startswith(("http://", "https://")):
        return DEFAULT_UI
    parts = urlsplit(uri)
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", ""))


def served_base(host: str, port: int | str) -> str:
    """``http://HOST:PORT`` of a server bound to ``host``: an address that binds every interface is reached on the
    loopback; an IPv6 address in brackets."""
    host = _reachable(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_url(uri: str, run_id: str) -> str | None:
    """The UI page of run ``run_id`` of the tracking store ``uri``; None when tracking is off (``uri`` empty, a
    ``local-`` id) or the store has no such run."""
    from pretrain.train import tracking

    if not uri or run_id.startswith(tracking.LOCAL_RUN_PREFIX):
        return None

    run = tracking.find_run(uri, run_id)
    return None if run is None else ui_url(ui_base(uri), run.info.experiment_id, run_id)


def print_run_link(tracking_enabled: bool, run_id: str) -> None:
    """The line of a new run's page (:func:`run_url` in the store every command uses, ``MLFLOW_TRACKING_URI``)
    below the next commands that ``grow``, ``prune`` and ``anneal`` print; nothing when the run is not tracked."""
    from pretrain.train.tracking import tracking_uri

    link = run_url(tracking_uri(), run_id) if tracking_enabled else None
    if link:
        print(f"  MLflow:  {link}")


def training_experiments(uri: str) -> list[tuple[str, str]]:
    """(id, name) of each experiment of the store that holds a run of ours, the one with the latest run first."""
    from pretrain.train.mlflow_records import mlflow_client
    from pretrain.train.tracking import TAG_KIND

    client = mlflow_client(uri)
    found = []
    for exp in client.search_experiments():
        runs = client.search_runs(
            [exp.experiment_id], filter_string=f"tags.`{TAG_KIND}` != ''", max_results=1, order_by=["start_time DESC"]
        )
        if runs:
            found.append((runs[0].info.start_time or 0, exp.experiment_id, exp.name))
    return [(exp_id, name) for _, exp_id, name in sorted(found, key=lambda f: -f[0])]


def open_when_serving(url: str, host: str, port: int, wait_s: float = 120.0) -> None:
    """Open ``url`` in the user's browser (Python's ``webbrowser``: ``$BROWSER``, else the desktop's) once a server
    accepts connections on ``host``:``port``, from a detached process, so that the caller can go on to become that
    server (``exec``). Where no browser is found it prints the URL to open instead; it never fails the caller."""
    child = os.fork()
    if child != 0:  # the caller; its child forks the one that waits, and exits at once (reaped here)
        os.waitpid(child, 0)
        return
    try:
        if os.fork() == 0:
            if _wait_for(_reachable(host), port, wait_s):
                if not webbrowser.open(url):
                    print(f"[pretrain] no browser found here: open {url}", flush=True)
            else:
                print(f"[pretrain] the UI did not answer on port {port} within {wait_s:.0f} s: not opened", flush=True)
    finally:
        os._exit(0)


def _reachable(host: str) -> str:
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(host, host.strip("[]"))


def _wait_for(host: str, port: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.5)
    return False
