"""The lock as data: what only torch (or Ray, or the dev tools) needs, read from the ``# via`` lines of the real
locks; the supported torch range, one source (pyproject.toml) that holds the locks' torch and takes NGC builds; a
filtered lock keeps every other pin byte for byte. The commands that use them: tests/integration/house/
test_install.py."""

from __future__ import annotations

import re

import pytest

from cluster.lockfile import (
    OPTIONAL,
    TOP,
    InstallError,
    build_requires,
    in_range,
    left_out,
    lock_text,
    optional_roots,
    parse_lock,
    release,
    torch_range,
)
from tests.conftest import ROOT

PYPROJECT = ROOT / "pyproject.toml"


def _pins(name: str):
    return parse_lock((ROOT / name).read_text())


def test_parse_reads_every_pin_its_hashes_and_what_needs_it():
    header, pins = _pins("requirements.lock")
    text = (ROOT / "requirements.lock").read_text()
    assert len(pins) == len(re.findall(r"^[A-Za-z0-9][^ ]*==", text, re.M))
    assert all(pin.hashes for pin in pins.values()), [n for n, p in pins.items() if not p.hashes]
    assert pins["torch"].version == "2.13.0+cpu" and TOP in pins["torch"].via
    assert {"datasets", "huggingface-hub", "torch"} <= pins["filelock"].via  # the multi-line form
    assert pins["mpmath"].via == {"sympy"}  # the one-line form
    assert header[0].startswith("# inputs-sha256: ")
    assert lock_text(header, pins, set(), {}) == text  # nothing dropped: the same file, byte for byte


def test_torch_takes_only_what_nothing_else_needs_in_both_locks():
    """The packages torch alone needs are the environment's; a package torch shares (filelock, jinja2, fsspec,
    typing-extensions) stays in the install, and so does the project's build backend (setuptools: torch is its only
    parent in the lock, but setup builds the project with it). In the CUDA lock, every nvidia-*, cuda-* and triton
    package goes with torch."""
    keep = build_requires(PYPROJECT)
    assert keep == {"setuptools"}
    _, cpu = _pins("requirements.lock")
    out = left_out(cpu, {"torch"}, keep)
    assert out == {"torch", "sympy", "mpmath", "networkx"}, out
    assert cpu["setuptools"].via == {"torch"} and "setuptools" not in out
    _, cuda = _pins("requirements-cuda.lock")
    out = left_out(cuda, {"torch"}, keep)
    gpu = {n for n in cuda if n.startswith(("nvidia-", "cuda-")) or n == "triton"}
    assert gpu and gpu <= out, gpu - out
    assert out - gpu == {"torch", "sympy", "mpmath", "networkx"}, out - gpu


def test_without_ray_and_dev_leave_out_what_only_they_need():
    _, pins = _pins("requirements.lock")
    keep = build_requires(PYPROJECT)
    torch_only = left_out(pins, {"torch"}, keep)
    ray = left_out(pins, {"torch"} | optional_roots(["ray"]), keep) - torch_only
    assert {"ray", "colorful", "py-spy", "opencensus"} <= ray
    assert not ray & {"aiohttp", "pyarrow", "pandas", "numpy", "packaging"}  # needed by others too
    dev = left_out(pins, {"torch"} | optional_roots(["dev"]), keep) - torch_only
    assert {"ruff", "mypy", "pytest", "pre-commit", "import-linter", "grimp"} <= dev
    assert "virtualenv" not in dev  # pre-commit's, and Ray's too
    asked = {re.split(r"[=\[ ]", line)[0].lower() for line in (ROOT / "requirements.txt").read_text().splitlines()}
    for name, roots in OPTIONAL.items():
        assert roots <= asked, (name, roots - asked)  # each is a package requirements.txt asks for by name
    with pytest.raises(InstallError, match=r"^--without mlflow: can leave out ray, dev \(comma-separated\)$"):
        optional_roots(["mlflow"])
    with pytest.raises(InstallError, match="nosuch: not in the lock"):
        left_out(pins, {"nosuch"}, keep)


def test_the_supported_range_holds_the_locks_torch_and_reads_builds_as_their_release():
    spec = torch_range(PYPROJECT)
    assert spec == ">=2.11,<2.14"
    for lock in ("requirements.lock", "requirements-cuda.lock"):
        assert in_range(_pins(lock)[1]["torch"].version, spec), lock
    assert release("2.11.0a0+ecf3bae40a.nv26.01") == (2, 11, 0)  # an NGC build
    assert in_range("2.11.0a0+ecf3bae40a.nv26.01", spec) and in_range("2.13.0+cu130", spec)
    assert not in_range("2.10.1", spec) and not in_range("2.14.0", spec) and not in_range("1.13.1", spec)
    assert in_range("2.5", ">=2.5.0,!=2.6,<=2.5.0") and not in_range("2.6.0", "!=2.6")
    with pytest.raises(InstallError, match=r"cannot read '~=2\.11'"):
        in_range("2.11.0", "~=2.11")
    with pytest.raises(InstallError, match="not a version number"):
        release("main")


def test_pips_sources_reach_uv_as_environment_variables_never_as_arguments(monkeypatch):
    """An index URL may hold credentials: uv gets pip's sources in its environment (a command line is readable by any
    local user), each kind with the sources it keeps. Through ``cluster/install.py uv-sources`` run by the Python
    setup runs it with (``python3``, whose pip reads the configuration)."""
    import os
    import subprocess

    from tests.conftest import ROOT

    for name in (
        "UV_INDEX_URL",
        "UV_DEFAULT_INDEX",
        "UV_INDEX",
        "UV_EXTRA_INDEX_URL",
        "UV_FIND_LINKS",
        "SSL_CERT_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip.conf aside
    monkeypatch.setenv("PIP_INDEX_URL", "https://alice:s3cret@pypi.example.com/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "https://mirror.example.com/a https://mirror.example.com/b")
    monkeypatch.setenv("PIP_FIND_LINKS", "/opt/wheels /srv/wheels")
    monkeypatch.setenv("PIP_CERT", "/etc/ssl/corp.pem")

    def uv_sources(kind: str) -> dict[str, str]:
        out = subprocess.run(
            [os.environ.get("PYTHON", "python3"), str(ROOT / "cluster" / "install.py"), "uv-sources", kind],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return dict(line.split("=", 1) for line in out.splitlines())

    index = {"UV_INDEX_URL": "https://alice:s3cret@pypi.example.com/simple", "SSL_CERT_FILE": "/etc/ssl/corp.pem"}
    extra = {"UV_EXTRA_INDEX_URL": "https://mirror.example.com/a https://mirror.example.com/b"}
    links = {"UV_FIND_LINKS": "/opt/wheels,/srv/wheels"}
    assert uv_sources("all") == {**index, **extra, **links}
    assert uv_sources("lock") == {**index, **links}
    assert uv_sources("cuda") == {**index, **extra}
    assert uv_sources("cuda-lock") == index
    monkeypatch.setenv("UV_INDEX_URL", "https://elsewhere.example.com/simple")  # uv's own, set: left alone
    assert uv_sources("all") == {}
