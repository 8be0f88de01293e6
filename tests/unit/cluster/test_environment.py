"""What a wheelhouse for one environment leaves to it, without the network: reading ``pip list`` output (freeze and
JSON), comparing versions, requirements.txt less ``--without``, and the split of a resolution into what the
environment brings (torch, what only torch needs, what it has at the version resolved) and what the wheelhouse holds.
The resolution and an install from it: tests/integration/house/test_install.py."""

from __future__ import annotations

import json

import pytest

from cluster.environment import direct_requirements, read_environment, resolve, same_version, split
from cluster.lockfile import InstallError, parse_lock
from tests.conftest import ROOT


def test_reads_pip_list_as_freeze_or_json(tmp_path):
    freeze = tmp_path / "env.txt"
    freeze.write_text(
        "# the GPU image\nTorch==2.11.0+cu130\n\nTyping_Extensions==4.16.0  # a note\n"
        "-e git+https://example.org/x.git#egg=x\nmine @ file:///src/mine\nnumpy==2.5.2\n"
    )
    assert read_environment(freeze) == {"torch": "2.11.0+cu130", "typing-extensions": "4.16.0", "numpy": "2.5.2"}
    listing = tmp_path / "env.json"
    listing.write_text(json.dumps([{"name": "torch", "version": "2.13.0+cpu"}, {"name": "MarkupSafe", "version": "3"}]))
    assert read_environment(listing) == {"torch": "2.13.0+cpu", "markupsafe": "3"}
    # the GPU machines' environment, as benchmarks/environments/ records it
    gpu = read_environment(ROOT / "benchmarks" / "environments" / "gpu-cuda-image.txt")
    assert gpu["torch"] == "2.11.0+cu130" and gpu["transformers"] == "5.17.0" and "deepspeed" not in gpu


def test_refuses_what_is_not_pip_list_output_in_one_line(tmp_path):
    bad = tmp_path / "bad.txt"
    cases = [
        ("torch==2.11.0\nnumpy>=2\n", r"bad.txt:2: expected NAME==VERSION \(pip list --format=freeze\)"),
        ("numpy==2.5.2\n", r"bad.txt: no torch \(the wheelhouse installs around the environment's\)"),
        ('[{"name": "torch"}]', r"bad.txt: not pip list --format=json output"),
        ('[{"name": "numpy", "version": "2.0.0"}]', r"bad.txt: no torch \(the wheelhouse installs around"),
    ]
    for text, message in cases:
        bad.write_text(text)
        with pytest.raises(InstallError, match=message):
            read_environment(bad)
    with pytest.raises(InstallError, match="--environment .*missing.txt: No such file"):
        read_environment(tmp_path / "missing.txt")


def test_same_version_up_to_trailing_zeros_and_case():
    assert same_version("1.0", "1.0.0") and same_version("V2.4", "2.4.0") and same_version("3.0.4", "3.0.4")
    assert same_version("2.11.0+CU130", "2.11+cu130") and same_version("2026.9.0", "2026.09.0")
    assert not same_version("2.11.0+cu130", "2.11.0") and not same_version("1.2rc1", "1.2")
    assert not same_version("1.17.0", "1.0.0") and not same_version("1.10", "1.1")


def test_direct_requirements_are_requirements_txts_pins_less_without():
    lines = direct_requirements(ROOT / "requirements.txt", ["ray", "dev"])
    assert "deepspeed==0.19.8" in lines and "transformers==5.23.0" in lines and "accelerate==1.15.0" in lines
    assert not [ln for ln in lines if ln.startswith(("ray", "pytest", "ruff", "mypy", "hypothesis"))]
    assert any(ln.startswith("ray[default,train]==") for ln in direct_requirements(ROOT / "requirements.txt", []))


LOCK = """\
deepspeed==0.19.8
    # via -r requirements.txt
torch==2.11.0
    # via
    #   -c the environment's torch 2.11.0
    #   deepspeed
sympy==1.14.0
    # via torch
jinja2==3.1.6
    # via
    #   torch
    #   mlflow
mlflow==3.17.0
    # via -r requirements.txt
pyarrow==25.0.1
    # via mlflow
setuptools==81.0.0
    # via
    #   -r requirements.txt
    #   torch
"""


def test_split_leaves_torch_its_own_and_what_the_environment_has_at_the_version_resolved():
    _, pins = parse_lock(LOCK)
    env = {"torch": "2.11.0+cu130", "jinja2": "3.1.6", "pyarrow": "26.0.1", "mlflow": "3.17", "setuptools": "80.0"}
    drop, have = split(pins, env, {"setuptools"})
    # torch and sympy (only torch needs it) whatever the environment has; jinja2 and mlflow at the same version;
    # pyarrow 26.0.1 is not the 25.0.1 mlflow's range allowed, setuptools 80.0 not the one resolved: in the wheelhouse
    assert drop == {"torch", "sympy", "jinja2", "mlflow"} and have == {"jinja2": "3.1.6", "mlflow": "3.17"}
    _, pins = parse_lock(LOCK.split("torch==")[0])
    assert split(pins, env, set()) == (set(), {})  # no torch in the resolution: nothing needs it


def test_resolve_refuses_a_platform_it_cannot_name(tmp_path):
    with pytest.raises(InstallError, match="--platform linux_x86_64: expected manylinux_2_"):
        resolve(["six==1.17.0"], {"torch": "2.11.0"}, [], "3.12", "linux_x86_64", "uv", tmp_path)
