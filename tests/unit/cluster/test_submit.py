"""Cluster jobs without a cluster: the shipped cluster manifests and the multi-node doc, and the Jobs API client's
logic (commands, address and token resolution, the job environment, the staged working directory). The commands
and a real local Ray head are in ``tests/integration/cluster/test_cluster.py``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

MANIFESTS = ROOT / "cluster" / "manifests"
_CLIENT_ENV_DROP = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")


# ------------------------------------------------------------------------------------------------
# Manifests
# ------------------------------------------------------------------------------------------------


def _docs(name: str) -> list[dict]:
    docs = [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d is not None]
    assert docs, f"{name} is empty"
    return docs


def _walk(node):
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_kuberay_rayjob_manifest():
    docs = _docs("kuberay-rayjob.yaml")
    for d in docs:
        assert d.get("apiVersion") and d.get("kind"), d
    (job,) = [d for d in docs if d["kind"] == "RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    assert "python -m pretrain train" in spec["entrypoint"]
    assert "checkpoint.dir=/mnt/shared" in spec["entrypoint"]
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http")
    # a stop is a checkpoint: Ray waits for it (its default is 3 s), and `stop` knows how long, as `submit` sets them
    from cluster.submit import STOP_MARGIN_S, STOP_WAIT_KEY
    from pretrain.config import CheckpointConfig

    wait = str(int(CheckpointConfig().stop_timeout_s) + STOP_MARGIN_S)
    assert runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == spec["metadata"][STOP_WAIT_KEY] == wait
    cluster = spec["rayClusterSpec"]
    assert cluster["authOptions"]["mode"] == "token"
    head = cluster["headGroupSpec"]
    assert "dashboard-host" in head["rayStartParams"]
    pvcs = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert pvcs and all(
        "ReadWriteMany" in d["spec"]["accessModes"] for d in docs if d["kind"] == "PersistentVolumeClaim"
    )

    def mounts_shared(pod_spec: dict) -> bool:
        vols = {v["name"]: v for v in pod_spec.get("volumes", [])}
        for c in pod_spec["containers"]:
            for m in c.get("volumeMounts", []):
                claim = vols.get(m["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
                if m["mountPath"] == "/mnt/shared" and claim in pvcs:
                    return True
        return False

    assert mounts_shared(head["template"]["spec"])
    groups = cluster["workerGroupSpecs"]
    assert groups
    for g in groups:
        pod = g["template"]["spec"]
        assert mounts_shared(pod)
        gpus = [c["resources"]["limits"].get("nvidia.com/gpu") for c in pod["containers"]]
        assert all(int(n) >= 1 for n in gpus), gpus


def test_cluster_launcher_manifest():
    (cfg,) = _docs("cluster-launcher-aws.yaml")
    for key in (
        "cluster_name",
        "provider",
        "auth",
        "available_node_types",
        "head_node_type",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    ):
        assert key in cfg, key
    assert cfg["provider"]["type"] in ("aws", "gcp")
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    workers = [t for name, t in types.items() if name != cfg["head_node_type"]]
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers)
    head_start = " ".join(cfg["head_start_ray_commands"])
    assert "--head" in head_start and "--dashboard-host=127.0.0.1" in head_start
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in " ".join(cfg["worker_start_ray_commands"])
    mounts = " ".join(cfg.get("initialization_commands", []) + cfg.get("setup_commands", []))
    assert re.search(r"mount .*/mnt/shared", mounts), "shared checkpoint storage is not mounted"
    assert "./launch.sh submit --address http://127.0.0.1:8265" in (MANIFESTS / "cluster-launcher-aws.yaml").read_text()


def test_mlflow_server_manifest():
    docs = _docs("mlflow-server.yaml")
    kinds = {d["kind"]: d for d in docs}
    assert {"Deployment", "Service"} <= set(kinds)
    for d in docs:
        assert d["apiVersion"] and d["metadata"]["name"]
    (container,) = kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
    cmd = " ".join(container.get("command", []) + container.get("args", []))
    assert "mlflow server" in cmd and "--backend-store-uri" in cmd and "--artifacts-destination" in cmd
    assert kinds["Service"]["spec"]["type"] == "ClusterIP"


def test_multinode_doc_covers_the_essentials():
    text = (ROOT / "docs" / "multi-node.md").read_text()
    for needle in (
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_",
        "NCCL_DEBUG",
        "checkpoint.dir",
        "shared",
        "MLFLOW_TRACKING_URI",
        "runtime_env",
        "./launch.sh resume",
        "checkpoint.resume_from",
        "cluster up",
        "RAY_AUTH_TOKEN",
    ):
        assert needle in text, needle
    # a server outside Kubernetes: a private address and a login, never every interface with none
    servers = re.findall(r"^mlflow server .*?(?<!\\)$", text, re.MULTILINE | re.DOTALL)
    assert servers
    for cmd in servers:
        assert "--host 0.0.0.0" not in cmd and "--app-name basic-auth" in cmd, cmd


# ------------------------------------------------------------------------------------------------
# Client logic (no cluster)
# ------------------------------------------------------------------------------------------------


def test_commands_registered():
    from pretrain.cli import COMMANDS
    from pretrain.cli import __doc__ as doc

    for name in ("cluster", "submit", "jobs", "status", "logs", "stop"):
        assert name in COMMANDS
        assert f"\n    {name} " in doc


def test_job_env_is_an_allowlist(monkeypatch):
    from cluster import submit

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    monkeypatch.setenv("MY_VAR", "x")
    env = submit.job_env(local=False, extra=["MY_VAR", "OTHER=1"])
    assert "AWS_SECRET_ACCESS_KEY" not in env and "PATH" not in env and "HOME" not in env
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["MY_VAR"] == "x" and env["OTHER"] == "1" and env["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"
    assert "TORCH_EXTENSIONS_DIR" not in env
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    local = submit.job_env(local=True, extra=[], gcs_address="127.0.0.1:6379")
    assert local["MLFLOW_TRACKING_URI"].startswith("sqlite:////") and local["RAY_ADDRESS"] == "127.0.0.1:6379"
    # relative stores and paths as this shell resolves them: the job runs in Ray's copy of the code, elsewhere
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///runs.db")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", ".cache/ext")
    local = submit.job_env(local=True, extra=[])
    assert local["MLFLOW_TRACKING_URI"] == f"sqlite:///{Path.cwd().resolve() / 'runs.db'}"
    assert local["TORCH_EXTENSIONS_DIR"] == str(Path.cwd().resolve() / ".cache" / "ext")
    assert submit.NETWORK_ENV == tuple(k for k in submit.JOB_ENV if k.startswith(("NCCL_", "GLOO_")))
    from cluster.launch import _FORWARD_ENV

    assert set(submit.NETWORK_ENV) <= set(_FORWARD_ENV), "the job's workers get what the job got"
    with pytest.raises(submit.ClusterUsageError, match="^--env NOT_SET_ANYWHERE_123: not set in this environment"):
        submit.job_env(local=False, extra=["NOT_SET_ANYWHERE_123"])
    # a value passed for a name (--env "$HF_TOKEN") is not echoed whole
    with pytest.raises(submit.ClusterUsageError) as e:
        submit.job_env(local=False, extra=["hf_abcdefghijklmnopqrstuvwxyz0123"])
    assert "abcdefghijklmnop" not in str(e.value) and str(e.value).startswith("--env 'hf_'... (33 characters")
    for value in ("2m", "90.5"):  # Ray's job supervisor takes whole seconds (int()): a fraction fails the stop
        with pytest.raises(submit.ClusterUsageError, match=f"STOP_WAIT_TIME_S={value}: not a whole number of seconds"):
            submit.job_env(local=False, extra=[f"RAY_JOB_STOP_WAIT_TIME_S={value}"])


def test_the_image_leaves_out_what_the_upload_leaves_out():
    """The Dockerfile copies the checkout (COPY . .): .dockerignore lists every exclude and credential file of
    `submit`, credentials at any depth."""
    from cluster import submit

    lines = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    lines = {line for line in lines if line and not line.startswith("#")}
    for name in submit.EXCLUDES:
        assert name in lines or f"**/{name}" in lines, name
    for name in submit.SECRETS:
        assert f"**/{name}" in lines, name


def test_staged_working_dir_mirrors_repo_with_excludes():
    from cluster import submit

    stage = submit._stage_working_dir("name: x\n")
    try:
        names = {p.name for p in stage.iterdir()}
        assert {"pretrain", "cluster", "configs"} <= names
        assert not names & {".venv", ".git", ".cache", "checkpoints", "mlflow.db", "mlartifacts"}
        assert (stage / submit.JOB_CONFIG_NAME).read_text() == "name: x\n"
        assert (stage / "pretrain").is_symlink()
        assert not any(p.exists() and not p.is_symlink() for p in stage.iterdir() if p.name != submit.JOB_CONFIG_NAME)
    finally:
        shutil.rmtree(stage)
    assert not (ROOT / submit.JOB_CONFIG_NAME).exists()  # nothing written into the checkout


def test_the_upload_leaves_out_credentials_and_the_runs_checkpoints_whatever_their_name(monkeypatch, capsys):
    from cluster import submit
    from pretrain.config import load_config

    monkeypatch.chdir(ROOT)
    cfg = load_config(None, ["checkpoint.dir=ckpt/mine", "data.cache_dir=/elsewhere/cache"])
    excludes = submit.upload_excludes(cfg)
    assert {".env", ".envrc", "*.pem", ".netrc", ".git-credentials", "/ckpt/mine"} <= set(excludes)
    assert {"venv", ".venv-*", ".tox"} <= set(excludes) and not any("elsewhere" in e for e in excludes)
    assert "/ckpt" in submit.upload_excludes(load_config(None, ["checkpoint.dir=ckpt"]))
    wheels = ROOT / "wheels-test-upload"
    wheels.mkdir()
    try:
        (wheels / "wheelhouse.json").write_text("{}")
        assert "/wheels-test-upload" in submit.upload_excludes(cfg), "a wheelhouse made in the checkout stays"
    finally:
        shutil.rmtree(wheels)
    outside = ROOT / "corpus-link-test-upload"
    outside.symlink_to("/usr/share", target_is_directory=True)  # a link out of the checkout: not uploaded
    try:
        stage = submit._stage_working_dir("name: x\n", [*excludes, "/configs"])  # a top-level entry, left out
    finally:
        outside.unlink()
    try:
        names = {p.name for p in stage.iterdir()}
        assert "configs" not in names and "pretrain" in names and outside.name not in names
    finally:
        shutil.rmtree(stage)
    assert f"[submit] not uploaded: {outside.name} (a link to /usr/share" in capsys.readouterr().err


def test_an_address_with_a_password_or_that_is_no_url_gets_one_line_without_the_password(capsys):
    """Every cluster command's error goes through :func:`cluster.head.run_cli`: one line, exit 1, an address's
    password shown as ``***`` (also in the ``--address`` of the commands ``submit`` prints)."""
    from cluster import connection, submit
    from cluster.head import run_cli

    def unreachable(argv):
        connection.connect("http://alice:hunter2@127.0.0.1:1")

    assert run_cli(unreachable, ["x"], "status") == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("error: cannot reach the Ray Jobs API at http://alice:***@127.0.0.1:1 ") and "hunter2" not in err
    )
    assert err.count("\n") == 1
    assert submit._hint("http://alice:hunter2@head:8265", explicit=True) == " --address http://alice:***@head:8265"


def test_the_run_id_is_read_from_the_jobs_log_with_or_without_tracking():
    from cluster.submit import _RUN_RE

    for line, run_id in (
        ("[pretrain] run 0123456789abcdef0123456789abcdef: demo, decoder", "0123456789abcdef0123456789abcdef"),
        ("[pretrain] resuming run 89abcdef0123 into /x", "89abcdef0123"),
        ("[pretrain] run local-0123456789ab: demo, decoder", "local-0123456789ab"),  # tracking.enabled=false
    ):
        assert _RUN_RE.search(f"noise\n{line}\n").group(1) == run_id


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--adress", "http://127.0.0.1:1"], "unrecognized arguments: --adress"),
        (["--dry-run"], "unrecognized arguments: --dry-run"),
        (["--wait", "nan"], "argument --wait: nan: seconds must be >= 0"),
    ],
)
def test_a_mistyped_option_is_refused_by_name_before_anything_is_read_or_sent(argv, says, capsys):
    """``submit``'s options are parsed whole: a mistyped one is named (it was read as the config path), and a
    ``--wait`` that is no duration (NaN: it waited for nothing, or forever) is refused."""
    from cluster.submit import submit
    from pretrain.cli import main
    from pretrain.config import ConfigError

    with pytest.raises(ConfigError, match=f"^launch.sh submit: {re.escape(says)}$"):
        submit(argv)
    assert main(["submit", *argv]) == 2  # one line, no usage text
    assert capsys.readouterr().err == f"error: launch.sh submit: {says}\n"
