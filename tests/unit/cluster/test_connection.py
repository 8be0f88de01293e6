"""How the cluster commands reach a Jobs API (``cluster/connection.py``) without a cluster: the address and the token
resolved, the address given being the one talked to. A real local Ray head is in
``tests/integration/cluster/test_cluster.py``."""

from __future__ import annotations

import json
import os

import pytest

from tests.unit.cluster.test_submit import _CLIENT_ENV_DROP


def test_address_and_token_resolution(tmp_path, monkeypatch):
    from cluster import connection

    for k in _CLIENT_ENV_DROP:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PRETRAIN_RAY_HEAD_DIR", str(tmp_path / "head"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert connection.resolve_address(None) == "http://127.0.0.1:8265"
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "auth_token").write_text("a" * 64)
    state = {"address": "http://127.0.0.1:18999", "token_path": str(tmp_path / "head" / "auth_token")}
    (tmp_path / "head" / "state.json").write_text(json.dumps(state))
    assert connection.resolve_address(None) == "http://127.0.0.1:18999"
    # a head that is not running (no process, or a process of another session) lends nobody its token
    assert (
        connection.auth_token("http://127.0.0.1:18999") == ("", "") and connection.local_head(state["address"]) is None
    )
    (tmp_path / "head" / "state.json").write_text(json.dumps({**state, "gcs_pid": os.getpid(), "sid": 1}))
    assert connection.auth_token("http://127.0.0.1:18999") == ("", "")
    # the recorded head alive (this process stands in for its GCS server)
    (tmp_path / "head" / "state.json").write_text(json.dumps({**state, "gcs_pid": os.getpid(), "sid": os.getsid(0)}))
    assert connection.local_head("http://localhost:18999") is not None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:8265")
    assert connection.resolve_address(None) == "http://10.0.0.5:8265"
    assert connection.resolve_address("https://head:443/") == "https://head:443"
    with pytest.raises(connection.ClusterError):
        connection.resolve_address("ray://head:10001")
    # the local head's token only for the local head's address
    assert connection.auth_token("http://localhost:18999") == ("a" * 64, "the local head's token file")
    assert connection.auth_token("http://10.0.0.5:8265") == ("", "")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    (tmp_path / "tok").write_text("b" * 64 + "\n")
    assert connection.auth_token("http://10.0.0.5:8265") == ("b" * 64, "RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "c" * 64)
    assert connection.auth_token("http://10.0.0.5:8265") == ("c" * 64, "RAY_AUTH_TOKEN")
    # a token set for another cluster never replaces the live local head's own (`cluster down` stops its jobs with it)
    assert connection.auth_token("http://127.0.0.1:18999") == ("a" * 64, "the local head's token file")


def test_the_address_given_is_the_one_talked_to_whatever_ray_address_says(tmp_path, monkeypatch):
    """Ray's client would take ``RAY_ADDRESS`` over the address it is given; ``--address`` goes first here (the token
    and the messages are the given address's, so the requests must be too)."""
    import http.server
    import threading

    from cluster import connection

    hits: dict[int, list[str]] = {}

    class Ray(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # what Ray's client asks first: the server's Ray version
            hits.setdefault(self.server.server_port, []).append(self.path)
            body = json.dumps({"ray_version": "2.60.0", "version": "4", "ray_commit": "x"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ray) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    other, given = (f"http://127.0.0.1:{server.server_port}" for server in servers)
    for k in _CLIENT_ENV_DROP:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PRETRAIN_RAY_HEAD_DIR", str(tmp_path / "head"))
    monkeypatch.setenv("RAY_ADDRESS", other)
    try:
        client = connection.connect(connection.resolve_address(given))
    finally:
        for server in servers:
            server.shutdown()
    assert client.get_address() == given and os.environ["RAY_ADDRESS"] == other
    assert set(hits) == {servers[1].server_port}, hits


def test_a_bad_job_id_or_address_is_a_usage_error(capsys):
    """Bad arguments of the cluster commands are one line and exit 2 (a cluster that fails: exit 1)."""
    from cluster import connection
    from cluster.head import run_cli

    def call(fn, *args):
        return run_cli(lambda argv: fn(*args), ["x"], "status"), capsys.readouterr().err

    assert call(connection.check_job_id, "bad id; rm -rf") == (2, "error: 'bad id; rm -rf': not a job id\n")
    code, err = call(connection.resolve_address, "ray://head:10001")
    assert code == 2 and err.startswith("error: ray://head:10001: not a Jobs API address")
    assert call(connection._endpoint, "http://[::1") == (2, "error: http://[::1: invalid address\n")
