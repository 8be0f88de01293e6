"""``./launch.sh setup`` around an environment's torch, and offline from a wheelhouse, run as commands on a checkout
of the launcher and the package skeleton (what the Dockerfile copies first) whose lock is a subset of the real one:
the real pins and hashes, few enough packages to install in seconds. The environment is a venv holding the lock's
CPU torch (from uv's cache or the package index, hash-checked), treated as the system's; the offline install runs
with every package source pointing at a dead port, empty caches, and uv taken from the wheelhouse."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.lockfile import lock_text, parse_lock, sha256
from tests.conftest import ROOT

SKELETON = [
    "launch.sh",
    "pyproject.toml",
    "requirements.txt",
    "requirements-torch.txt",
    "requirements-cuda.lock",
    "cluster/__init__.py",
    "cluster/install.py",
    "cluster/environment.py",
    "cluster/lockfile.py",
    "cluster/wheelhouse.py",
    "pretrain/__init__.py",
    "eval/__init__.py",
    "benchmarks/__init__.py",
]
TORCH = {"torch", "sympy", "mpmath", "networkx", "filelock", "jinja2", "markupsafe", "fsspec", "typing-extensions"}
# The environment brings torch and what it needs; the checkout's lock adds packages only it has, one the environment
# has at another version (six), the build backend, the installer, DeepSpeed's sdist, and Ray with what only it needs.
OURS = {"setuptools", "packaging", "six", "uv"}
OFFLINE = {"deepspeed", "hjson", "ray", "colorful", "aiohttp-cors"}
DEEPSPEED_NEEDS = {"einops", "msgpack", "ninja", "numpy", "psutil", "py-cpuinfo", "pydantic", "tqdm"}
DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens


def _uv() -> str:
    version = re.search(r'^UV_VERSION="([^"]+)"', (ROOT / "launch.sh").read_text(), re.M).group(1)
    cached = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pretrain" / f"uv-{version}" / "uv"
    return str(cached) if cached.is_file() else (shutil.which("uv") or pytest.skip("uv: ./launch.sh setup fetches it"))


def _env(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PRETRAIN_")}
    return {**env, **changes}


def _offline_env(tmp: Path, **changes: str) -> dict[str, str]:
    """No package source reachable (pip's and uv's point at a dead port, as do the proxies), empty caches."""
    env = {k: v for k, v in _env().items() if not k.startswith(("PIP_", "UV_")) and "proxy" not in k.lower()}
    blocked = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": DEAD, "UV_INDEX_URL": DEAD, "UV_OFFLINE": "1"}
    blocked |= {k: DEAD for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
    caches = {"XDG_CACHE_HOME": str(tmp / "xdg"), "UV_CACHE_DIR": str(tmp / "uv-cache")}
    return {**env, **blocked, **caches, **changes}


def _checkout(dest: Path, names: set[str]) -> Path:
    for rel in SKELETON:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    header, pins = parse_lock((ROOT / "requirements.lock").read_text())
    (dest / "requirements.lock").write_text(lock_text(header, pins, set(pins) - names, {}))
    return dest


def _launch(checkout: Path, *args: str, env: dict[str, str], timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(checkout / "launch.sh"), *args],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _site(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


@pytest.fixture(scope="module")
def environment(tmp_path_factory) -> Path:
    """The Python of an environment that has the lock's CPU torch and what it needs, pip (what setup --offline
    installs with when no uv is at hand), six 1.0.0, older than the lock's, and what DeepSpeed needs at the lock's
    versions, which the subset lock of the wheelhouse test leaves out (their metadata is all a version is to an
    install, and to setup's check that every requirement is met)."""
    root = tmp_path_factory.mktemp("environment")
    uv = _uv()
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(root / "env")], check=True)
    header, pins = parse_lock((ROOT / "requirements.lock").read_text())
    (root / "torch.txt").write_text(lock_text(header, pins, set(pins) - TORCH, {}))
    sources = subprocess.run(  # pip's package sources (this machine's CPU torch wheel is found through them)
        [os.environ.get("PYTHON", "python3"), str(ROOT / "cluster" / "install.py"), "uv-sources", "all"],
        env=_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    subprocess.run(
        [
            uv,
            "pip",
            "sync",
            "-q",
            "--python",
            str(root / "env" / "bin" / "python"),
            "--require-hashes",
            "--index-strategy",
            "unsafe-best-match",
            str(root / "torch.txt"),
        ],
        check=True,
        env={**_env(), **dict(line.split("=", 1) for line in sources)},
    )
    subprocess.run(  # pip: any version with --python (22.3 or later)
        [uv, "pip", "install", "-q", "--python", str(root / "env" / "bin" / "python"), "pip>=22.3"],
        check=True,
        env={**_env(), **dict(s.split("=", 1) for s in sources if s.startswith("SSL_CERT_FILE="))},
    )
    for name, version in [("six", "1.0.0"), *((n, pins[n].version) for n in sorted(DEEPSPEED_NEEDS))]:
        info = _site(root / "env") / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root / "env" / "bin" / "python"


def test_setup_keeps_the_environments_torch_and_refuses_one_out_of_range(tmp_path, environment):
    checkout = _checkout(tmp_path / "checkout", TORCH | OURS)
    env = _env(PYTHON=str(environment), PRETRAIN_TORCH="system")
    proc = _launch(checkout, "setup", env=env)
    assert proc.returncode == 0, proc.stderr
    base = _site(environment.parent.parent)
    assert "[setup] left to the environment: mpmath, networkx, sympy, torch\n" in proc.stderr
    verified = f"[setup] torch 2.13.0+cpu from the environment ({base}); the lock's versions shadow 1 of its packages"
    assert f"{verified}: six 1.0.0 -> 1.17.0\n" in proc.stderr, proc.stderr
    venv = checkout / ".venv"
    installed = {p.name.split("-")[0].lower() for p in _site(venv).glob("*.dist-info")}
    assert installed == {"filelock", "fsspec", "jinja2", "markupsafe", "typing_extensions", "pretrain"} | OURS
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import torch, sympy, six; print(torch.__file__, sympy.__file__, six.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    ).stdout.split()
    assert [Path(w).is_relative_to(base) for w in where] == [True, True, False]  # six: the lock's, in the venv
    stamp = (venv / ".pretrain-setup").read_text().splitlines()
    assert re.fullmatch(
        rf"requirements\.lock sha256=[0-9a-f]{{64}} python \d+\.\d+ "
        rf"around the environment's torch 2\.13\.0\+cpu cpu {base}",
        stamp[0],
    )
    again = _launch(checkout, "setup", env=env)
    assert again.returncode == 0 and again.stderr == "", again.stderr  # current: nothing to do
    plain = _launch(checkout, "setup", env=_env())  # neither PYTHON nor PRETRAIN_TORCH: setup's are kept
    assert plain.returncode == 0 and plain.stderr == "", plain.stderr
    # A torch outside the supported range: one line naming the range, the venv as it was; found automatically too
    # (PRETRAIN_TORCH unset), since it is a CUDA build.
    old = tmp_path / "old"
    subprocess.run([_uv(), "venv", "-q", "--python", sys.executable, str(old)], check=True)
    (_site(old) / "torch-2.9.0+cu128.dist-info").mkdir()
    (_site(old) / "torch-2.9.0+cu128.dist-info" / "METADATA").write_text("Name: torch\nVersion: 2.9.0+cu128\n")
    (_site(old) / "torch").mkdir()
    (_site(old) / "torch" / "version.py").write_text("cuda = '12.8'\n")
    for choice in ({"PRETRAIN_TORCH": "system"}, {}):
        proc = _launch(checkout, "setup", env=_env(PYTHON=str(old / "bin" / "python"), **choice))
        assert proc.returncode == 2 and proc.stderr == (
            f"[setup] error: torch 2.9.0+cu128 in {old / 'bin' / 'python'} is outside the supported range "
            ">=2.11,<2.14 (pyproject.toml [tool.pretrain] torch); PRETRAIN_TORCH=cuda|cpu installs the lock's torch\n"
        ), proc.stderr
    assert (venv / ".pretrain-setup").read_text().splitlines() == stamp


def test_offline_setup_installs_a_wheelhouse_with_no_network(tmp_path, environment):
    """``wheelhouse --without ray`` collects the lock's wheels less torch's and Ray's, builds DeepSpeed's from its
    sdist, prints the sizes; ``setup --offline`` installs them hash-checked with every source unreachable, and later
    setups stay offline. A wheel changed after the fact is refused."""
    names = TORCH | OURS | OFFLINE
    wheels = tmp_path / "wheelhouse"
    proc = _launch(_checkout(tmp_path / "online", names), "wheelhouse", str(wheels), "--without", "ray", env=_env())
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((wheels / "wheelhouse.json").read_text())
    files = {f["name"]: f for f in manifest["files"]}
    assert set(files) == names - {"torch", "sympy", "mpmath", "networkx", "ray", "colorful", "aiohttp-cors"}
    assert manifest["without"] == ["ray"] and {"ray", "colorful", "aiohttp-cors", "torch"} <= set(manifest["left_out"])
    for f in files.values():
        assert (wheels / f["file"]).stat().st_size == f["bytes"] and sha256(wheels / f["file"]) == f["sha256"]
    _, pins = parse_lock((ROOT / "requirements.lock").read_text())
    assert files["deepspeed"]["file"] == "deepspeed-0.19.8-py3-none-any.whl"
    assert files["deepspeed"]["built_from"]["sha256"] in pins["deepspeed"].hashes  # the lock's sdist, built here
    weighs = manifest["by_requirement"]  # each asked-for package with what only it needs; uv, the installer
    assert weighs["deepspeed"] == files["deepspeed"]["bytes"] + files["hjson"]["bytes"], weighs
    assert weighs["uv"] == files["uv"]["bytes"] and "[wheelhouse] by requirement, each with what only" in proc.stdout
    total = sum(f["bytes"] for f in files.values()) / 2**20
    assert re.search(rf"^ +{total:.1f} MiB  in all \(manifest", proc.stdout, re.M), proc.stdout
    assert re.search(
        r"^ +\d+\.\d MiB  deepspeed-0\.19\.8-py3-none-any\.whl  \(built from its sdist\)$", proc.stdout, re.M
    )

    checkout = _checkout(tmp_path / "offline", names)
    env = _offline_env(tmp_path, PYTHON=str(environment))
    proc = _launch(checkout, "setup", "--offline", str(wheels), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "not in the wheelhouse (--without ray): 3 packages" in proc.stderr
    installed = {p.name.split("-")[0].lower() for p in _site(checkout / ".venv").glob("*.dist-info")}
    assert installed == {n.replace("-", "_") for n in files} | {"pretrain"}
    assert (tmp_path / "xdg" / "pretrain").is_dir()  # uv: from the wheelhouse
    assert _launch(checkout, "setup", env=env).stderr == ""  # a later setup: current, still offline
    # and without PYTHON: the environment setup was given is kept (a plain python3 has no torch to set up around)
    plain = _launch(checkout, "setup", env={k: v for k, v in env.items() if k != "PYTHON"})
    assert plain.returncode == 0 and plain.stderr == "", plain.stderr
    tampered = tmp_path / "tampered"
    shutil.copytree(wheels, tampered)
    with (tampered / files["six"]["file"]).open("ab") as f:
        f.write(b"\0")
    proc = _launch(_checkout(tmp_path / "other", names), "setup", "--offline", str(tampered), env=env)
    assert proc.returncode != 0 and "hash" in proc.stderr.lower(), proc.stderr


def test_a_wheelhouse_for_an_environment_holds_only_what_it_lacks(tmp_path, environment):
    """``wheelhouse --environment`` with the environment's ``pip list --format=json``: requirements.txt's pins, and
    of what they need only what the environment lacks at a version they accept (its markupsafe 3.0.4 stays; its six
    1.0.0 is below python-dateutil's ``six>=1.5``); no uv. ``setup --offline`` installs it with the environment's
    pip, the network blocked and no uv at hand, around the environment's packages, every requirement checked."""
    direct = "mako==1.4.3\npython-dateutil==2.9.0.post0\n"  # mako needs MarkupSafe>=0.9.2, python-dateutil six>=1.5
    checkout = _checkout(tmp_path / "online", TORCH | OURS)
    (checkout / "requirements.txt").write_text(direct)
    listing = subprocess.run(
        [_uv(), "pip", "list", "--format=json", "--python", str(environment)],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    ).stdout
    (tmp_path / "environment.json").write_text(listing)
    wheels = tmp_path / "wheelhouse"
    args = ("wheelhouse", str(wheels), "--environment", str(tmp_path / "environment.json"))
    proc = _launch(checkout, *args, env=_env())
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((wheels / "wheelhouse.json").read_text())
    files = {f["name"]: f["version"] for f in manifest["files"]}
    assert set(files) == {"mako", "python-dateutil", "six", "setuptools", "packaging"}, files  # setup's own needs
    assert files["mako"] == "1.4.3" and files["python-dateutil"] == "2.9.0.post0" and files["six"] != "1.0.0"
    assert manifest["environment"]["left_to_environment"] == {"markupsafe": "3.0.4"}
    assert manifest["environment"]["torch"] == "2.13.0+cpu"
    assert "left to the environment of environment.json: torch 2.13.0+cpu and what only it needs, and 1 " in proc.stdout
    lock = (wheels / "requirements.txt").read_text()
    assert re.search(r"^six==\S+ \\$", lock, re.M) and not re.search(r"^(markupsafe|torch)==", lock, re.M), lock

    offline = _checkout(tmp_path / "offline", TORCH | OURS)
    (offline / "requirements.txt").write_text(direct)
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "uv").exists())
    env = _offline_env(tmp_path, PYTHON=str(environment), PATH=path)
    proc = _launch(offline, "setup", "--offline", str(wheels), env=env)
    assert proc.returncode == 0, proc.stderr
    assert "and 1 packages it has at the version" in proc.stderr, proc.stderr
    assert not (tmp_path / "xdg" / "pretrain").exists()  # no uv: the environment's pip installed
    venv = offline / ".venv"
    installed = {p.name.split("-")[0].lower() for p in _site(venv).glob("*.dist-info")}
    assert installed == {"mako", "python_dateutil", "six", "setuptools", "packaging", "pretrain"}, installed
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import markupsafe, mako, six; print(markupsafe.__file__, six.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    ).stdout.split()
    base = _site(environment.parent.parent)
    assert [Path(w).is_relative_to(base) for w in where] == [True, False]  # markupsafe: the environment's
    again = _launch(offline, "setup", env=env)  # a later setup: current (the test's requirements.txt: a warning)
    assert again.returncode == 0 and "[setup] creating" not in again.stderr, again.stderr
