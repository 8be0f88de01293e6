"""The links into the MLflow UI that every command prints (``pretrain/driver/ui_links.py``): they open as model
training (``?workflowType=machine_learning``), at ``./launch.sh ui``'s address or at the tracking server's, for a
real run of a real sqlite store; ``ui --open``'s browser is opened once the server answers, and its absence is
one line. The pages in a real browser: ``tests/integration/cli/test_help.py``."""

from __future__ import annotations

import socket
import stat
import time

import pytest

from pretrain.driver import ui_links
from pretrain.driver.ui_links import DEFAULT_UI, run_url, served_base, training_experiments, ui_base, ui_url
from pretrain.train import tracking
from pretrain.train.mlflow_records import mlflow_client

ML = "?workflowType=machine_learning"


def test_every_page_opens_as_model_training():
    assert DEFAULT_UI == "http://127.0.0.1:5000"
    assert ui_url(DEFAULT_UI) == f"http://127.0.0.1:5000/#/experiments{ML}"
    assert ui_url("http://h:1/", "7") == f"http://h:1/#/experiments/7{ML}"
    assert ui_url("http://h:1", "7", "abc") == f"http://h:1/#/experiments/7/runs/abc{ML}"
    assert (
        ui_url("http://h:1", "7", "abc", tab="model-metrics")
        == f"http://h:1/#/experiments/7/runs/abc/model-metrics{ML}"
    )
    with pytest.raises(ValueError, match="experiment id"):
        ui_url("http://h:1", run_id="abc")


@pytest.mark.parametrize(
    ("uri", "base"),
    [
        ("sqlite:////tmp/x/mlflow.db", DEFAULT_UI),
        ("/tmp/mlruns", DEFAULT_UI),
        ("databricks", DEFAULT_UI),
        ("http://mlflow.internal:8080", "http://mlflow.internal:8080"),
        ("https://user:secret@example.org/mlflow/?x=1", "https://example.org/mlflow/"),
    ],
)
def test_the_ui_of_a_store_is_the_tracking_server_or_launch_sh_ui(uri, base):
    """A tracking server serves its own UI (no credentials printed); any other store is served by ``ui``."""
    assert ui_base(uri) == base
    assert ui_url(ui_base(uri), "1") == f"{base.rstrip('/')}/#/experiments/1{ML}"


@pytest.mark.parametrize(
    ("host", "base"),
    [("127.0.0.1", "http://127.0.0.1:5001"), ("0.0.0.0", "http://127.0.0.1:5001"), ("::", "http://[::1]:5001")],
)
def test_the_served_address_is_one_a_browser_reaches(host, base):
    assert served_base(host, 5001) == base


def test_a_run_links_to_its_experiment_in_a_real_store(workdir):
    """The run's page names its experiment; no page for an untracked run, an unknown run or tracking off (and no
    store is created by asking)."""
    uri = tracking.tracking_uri()
    client = mlflow_client(uri)
    exp = tracking.get_or_create_experiment(uri, "pretrain")
    run = client.create_run(exp, tags={tracking.TAG_KIND: "decoder"}).info.run_id
    assert run_url(uri, run) == f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{run}{ML}"
    assert run_url(uri, "0" * 32) is None
    assert run_url("", run) is None
    assert run_url(uri, "local-0123456789ab") is None


def test_the_ui_lists_the_experiments_with_our_runs_latest_first(workdir):
    uri = tracking.tracking_uri()
    client = mlflow_client(uri)
    first = tracking.get_or_create_experiment(uri, "first")
    client.create_run(first, start_time=1_000, tags={tracking.TAG_KIND: "decoder"})
    other = client.create_experiment("not-ours", artifact_location=(workdir / "o").as_uri())
    client.create_run(other, start_time=3_000)
    later = tracking.get_or_create_experiment(uri, "later")
    client.create_run(later, start_time=2_000, tags={tracking.TAG_KIND: "encoder"})
    assert training_experiments(uri) == [(later, "later"), (first, "first")]


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_open_waits_for_the_server_then_opens_the_browser(tmp_path, monkeypatch, capfd):
    """``$BROWSER`` (a script that records its argument) is run only once the port accepts connections; without
    any browser the URL is printed instead, and the caller goes on either way."""
    opened = tmp_path / "opened.txt"
    browser = tmp_path / "browser.sh"
    browser.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    browser.chmod(browser.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("BROWSER", str(browser))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        ui_links.open_when_serving("http://127.0.0.1/x", "127.0.0.1", port, wait_s=30)
        time.sleep(1.0)
        assert not opened.exists()  # nothing listens yet
        s.listen()
        assert _wait_for(lambda: opened.is_file() and opened.read_text()).strip() == "http://127.0.0.1/x"

        for name in ("BROWSER", "DISPLAY", "WAYLAND_DISPLAY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        ui_links.open_when_serving("http://127.0.0.1/y", "0.0.0.0", port, wait_s=30)
        out = _wait_for(lambda: capfd.readouterr().out)
    assert out.strip() == "[pretrain] no browser found here: open http://127.0.0.1/y"


def test_ui_refuses_what_it_could_not_serve_in_one_line(workdir, monkeypatch, capsys):
    """Before MLflow's server is started: a port beyond 65535, a port in use (the links would open another server),
    a host that does not resolve or is not this machine's (not a busy port), and a tracking server as the store (it
    serves its own UI) are each one line, exit 2."""
    from pretrain.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, error in [
            (["--port", "70000"], "ui --port: a TCP port is at most 65535, got 70000"),
            (["--port", str(port)], f"ui --port {port}: 127.0.0.1:{port} is in use (another server?); pass another"),
            (["--host", "no-such-host.invalid"], "ui --host no-such-host.invalid: no-such-host.invalid:5000 does not "),
            (["--host", "192.0.2.1"], "ui --host 192.0.2.1: 192.0.2.1:5000 cannot be bound: 192.0.2.1 is not an "),
        ]:
            assert main(["ui", *args]) == 2
            assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {error}"), args
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:S3cretPW@127.0.0.1:5126")
    assert main(["ui"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: ui: the tracking store is an MLflow server (http://user:***@127.0.0.1:5126), which serves its own UI: "
        "open http://127.0.0.1:5126"
    )
