"""The project as an installed package, and the locked stack on every machine: the build configuration, Ray workers
without PYTHONPATH, no installed module importing the tests, the two locks (CPU and CUDA) with the same versions,
and the image both cluster manifests name (no build, no install). The ``pretrain`` console command and
``./launch.sh setup``'s refusal run as commands in ``tests/integration/house/test_package.py``."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import yaml

from tests.conftest import ROOT
from tests.unit.cluster.test_submit import _walk

LOCKS = {"cpu": ROOT / "requirements.lock", "cuda": ROOT / "requirements-cuda.lock"}


def test_build_lists_the_four_packages_and_builds_offline():
    """setuptools builds the project without fetching anything (it is in both locks; setup builds without
    isolation); the install holds ``pretrain`` (with the exported model's remote code), ``cluster`` and ``eval``,
    never ``tests``."""
    from setuptools import find_packages

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    system = project["build-system"]
    assert system["build-backend"] == "setuptools.build_meta"
    (req,) = system["requires"]
    assert req.startswith("setuptools")
    for lock in LOCKS.values():
        assert re.search(r"^setuptools==", lock.read_text(), re.M), f"{lock.name}: the build backend is not locked"
    found = set(find_packages(str(ROOT), include=project["tool"]["setuptools"]["packages"]["find"]["include"]))
    assert {
        "pretrain",
        "pretrain.export.remote_code",
        "pretrain.train",
        "pretrain.train.callbacks",
        "pretrain.driver",
        "cluster",
        "eval",
        "benchmarks",
    } <= found
    top = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert {p.split(".")[0] for p in found} == top - {"tests"} == {"pretrain", "cluster", "eval", "benchmarks"}


def test_ray_workers_get_no_pythonpath(monkeypatch):
    """Workers import the installed package: the worker environment carries no PYTHONPATH (an embedded local Ray's
    workers still inherit the driver's, which is how tests run their checkout's code)."""
    from cluster.launch import worker_env

    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = worker_env()
    assert "PYTHONPATH" not in env and env["HF_HUB_OFFLINE"] == "1"


def test_installed_code_imports_nothing_from_tests():
    """Test helpers live under tests/: no module of the four installed packages imports ``tests`` (the real-process
    launcher the ``bench`` modes and the tests share is ``pretrain/train/spawn.py``), and the tests import no test
    plumbing from ``benchmarks``. The tests mirror the source tree over one harness: ``tests/unit/<package>/
    test_<module>.py`` (a directory per source package; ``house/`` for the house rules that span packages; the top
    modules of ``pretrain`` directly in ``tests/unit``), ``tests/integration/<area>/``, ``tests/harness.py`` the shared
    multi-rank machinery."""
    for path in [*(p for pkg in ("pretrain", "cluster", "eval", "benchmarks") for p in ROOT.glob(f"{pkg}/**/*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n == "tests" or n.startswith("tests.") for n in names), path
    assert not (ROOT / "benchmarks" / "procs.py").exists() and (ROOT / "pretrain" / "train" / "spawn.py").is_file()
    tests = ROOT / "tests"
    assert "benchmarks" not in (tests / "harness.py").read_text()
    assert (tests / "harness.py").is_file() and not (tests / "distributed.py").exists()
    assert not list(tests.glob("test_*.py")), "a test file belongs in tests/unit or tests/integration"
    for kind in ("unit", "integration"):
        assert (tests / kind / "__init__.py").is_file(), kind
        for d in (p for p in (tests / kind).rglob("*") if p.is_dir() and p.name != "__pycache__"):
            assert (d / "__init__.py").is_file(), f"{d} needs an __init__.py (test modules are named by package)"
    assert not list((tests / "integration").glob("test_*.py")), "integration tests go in tests/integration/<area>/"
    for d in (p for p in (tests / "unit").rglob("*") if p.is_dir() and p.name not in ("__pycache__", "house")):
        rel = d.relative_to(tests / "unit")
        mirrored = (ROOT / "pretrain" / rel).is_dir() or (ROOT / rel).is_dir()
        assert mirrored, f"tests/unit/{rel} mirrors no package"
        assert list(d.glob("test_*.py")), d
    for f in (tests / "unit").glob("test_*.py"):
        assert (ROOT / "pretrain" / f.name.removeprefix("test_")).is_file(), f"{f.name} mirrors no pretrain module"


# -- the locks ------------------------------------------------------------------------------------------------


def _lock(path: Path) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes)."""
    out: dict[str, tuple[str, int]] = {}
    name = None
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if m:
            name = m.group(1).lower().replace("_", "-")
            out[name] = (m.group(2), 0)
        elif name and "--hash=sha256:" in line:
            out[name] = (out[name][0], out[name][1] + 1)
    return out


def test_cpu_and_cuda_locks_pin_the_same_versions():
    """``./launch.sh lock`` wrote both from the current inputs; every package they share has one version; torch is
    the CPU build in one and the index's CUDA build of the same version (with its nvidia-* libraries) in the other;
    every file of both is hash-checked."""
    import hashlib

    inputs = hashlib.sha256(
        (ROOT / "requirements-torch.txt").read_bytes() + (ROOT / "requirements.txt").read_bytes()
    ).hexdigest()
    for lock in LOCKS.values():
        assert lock.read_text().startswith(f"# inputs-sha256: {inputs} "), f"{lock.name} is stale: ./launch.sh lock"
    cpu, cuda = _lock(LOCKS["cpu"]), _lock(LOCKS["cuda"])
    shared = set(cpu) & set(cuda)
    differ = {n: (cpu[n][0], cuda[n][0]) for n in shared - {"torch"} if cpu[n][0] != cuda[n][0]}
    assert not differ, f"the locks disagree: {differ}"
    assert set(cpu) <= set(cuda), f"only in the CPU lock: {set(cpu) - set(cuda)}"
    torch_cpu, torch_cuda = cpu["torch"][0], cuda["torch"][0]
    assert torch_cpu.endswith("+cpu") and torch_cuda == torch_cpu.removesuffix("+cpu"), (torch_cpu, torch_cuda)
    extra = set(cuda) - set(cpu)
    assert "triton" in extra and any(n.startswith("nvidia-nccl") for n in extra), extra
    assert all(n.startswith(("nvidia-", "cuda-")) or n == "triton" for n in extra), extra
    assert not any(n.startswith("nvidia-") for n in cpu)
    for lock in (cpu, cuda):
        assert all(hashes for _, hashes in lock.values()), [n for n, (_, h) in lock.items() if not h]


def test_the_image_installs_the_cuda_lock_and_both_manifests_name_it():
    docker = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", docker, re.M).group(1)
    assert "gpu" in base or "cuda" in base, base
    assert re.search(r"^ENV PRETRAIN_TORCH=cuda", docker, re.M) and "DS_BUILD_OPS=0" in docker
    assert "./launch.sh setup" in docker and "requirements-cuda.lock" in docker
    copied = {
        p
        for line in re.findall(r"^COPY (?:--\S+ )*(.*?)(?: \./?)?$", docker.replace("\\\n", " "), re.M)
        for p in line.split()
    }
    setup_runs = {"cluster/install.py", "cluster/lockfile.py", "cluster/wheelhouse.py", "cluster/environment.py"}
    assert setup_runs <= copied  # setup runs them
    job = [d for d in yaml.safe_load_all((ROOT / "cluster/manifests/kuberay-rayjob.yaml").read_text()) if d]
    images = {c["image"] for d in job for node in _walk(d) for c in node.get("containers", [])}
    launcher = yaml.safe_load((ROOT / "cluster/manifests/cluster-launcher-aws.yaml").read_text())
    assert images == {launcher["docker"]["image"]} == {"REGISTRY/pretrain:VERSION"}, images
    (rayjob,) = [d for d in job if d["kind"] == "RayJob"]
    assert "PYTHONPATH" not in yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
    doc = (ROOT / "docs" / "multi-node.md").read_text()
    assert "docker build -t REGISTRY/pretrain:VERSION ." in doc and "docker push REGISTRY/pretrain:VERSION" in doc


def test_setup_refuses_a_driver_older_than_the_cuda_locks_torch_needs(tmp_path):
    """The CUDA lock's torch (CUDA 13) needs NVIDIA driver 580 or newer: with an older one torch would not see the
    GPU and every run would fall to the CPU, so ``setup`` refuses it in one line with what to do instead (a warning
    where ``PRETRAIN_TORCH=cuda`` asks for that lock: an image is built on another machine than it runs on). The
    version is read from the kernel module's banner (closed and open modules) or from ``nvidia-smi``, never from
    its error text."""
    import subprocess

    functions = subprocess.run(
        ["sed", "-n", "/^driver_version()/,/^}/p;/^check_cuda_driver()/,/^}/p", str(ROOT / "launch.sh")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()

    def bash(script: str, smi_says: str, **env: str) -> subprocess.CompletedProcess:
        smi.write_text(f"#!/bin/sh\necho '{smi_says}'\n")
        smi.chmod(0o755)
        return subprocess.run(
            ["bash", "-c", f"{functions}\n{script}", str(LOCKS["cuda"])],
            capture_output=True,
            text=True,
            env={"PATH": f"{smi.parent}:/usr/bin:/bin", **env},
        )

    banners = {
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024": "535.183.01",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs@U16)": "580.65.06",
        "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.86.15  Release Build  (dvs@U16)": "570.86.15",
    }
    for banner, version in banners.items():
        (tmp_path / "version").write_text(banner + "\n")
        assert bash(f"driver_version {tmp_path / 'version'}", "").stdout.strip() == version
    failed = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    assert bash(f"driver_version {tmp_path / 'none'}", failed).stdout.strip() == ""
    assert "nvidia-cuda-runtime==13." in LOCKS["cuda"].read_text()
    for driver, rc in (("535.183.01", 2), ("580.65.06", 0), ("", 0), (failed, 0)):  # no version: not this check's
        run = bash('check_cuda_driver "$0"', driver)
        assert run.returncode == rc, (driver, run.stderr)
        if rc:
            (line,) = run.stderr.splitlines()
            assert line.startswith(f"[setup] error: NVIDIA driver {driver} is older than 580, which the CUDA 13 torch")
            assert "PRETRAIN_TORCH=system" in line and "PRETRAIN_TORCH=cpu" in line
    asked = bash('check_cuda_driver "$0"', "535.183.01", PRETRAIN_TORCH="cuda")
    assert asked.returncode == 0 and asked.stderr.startswith("[setup] warning: NVIDIA driver 535.183.01 is older")
    # the choice an earlier PRETRAIN_TORCH=cuda setup left (.venv/.pretrain-choice), which later commands keep
    kept = bash('SAVED_KIND=cuda SAVED_ASKED=asked; check_cuda_driver "$0"', "535.183.01")
    assert kept.returncode == 0 and kept.stderr.startswith("[setup] warning: NVIDIA driver 535.183.01 is older")
    picked = bash('SAVED_KIND=cuda SAVED_ASKED=; check_cuda_driver "$0"', "535.183.01")  # setup's own pick
    assert picked.returncode == 2 and picked.stderr.startswith("[setup] error: NVIDIA driver 535.183.01 is older")


def test_what_the_commands_write_in_the_checkout_is_ignored_by_git_and_the_linters():
    """The default places of a run's outputs (the commands print them) are not the project's files: an export's
    bundled ``modeling_pretrain.py`` under ``exported/`` would otherwise fail ``ruff format --check``."""
    import subprocess

    written = ["exported/RUN/modeling_pretrain.py", "checkpoints/RUN/summary.json", "mlflow.db", "mlartifacts/1/x"]
    proc = subprocess.run(["git", "-C", str(ROOT), "check-ignore", *written], capture_output=True, text=True)
    assert proc.stdout.split() == written, proc.stdout + proc.stderr
