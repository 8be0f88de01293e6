"""The environment's torch: found from its metadata without importing it, CUDA or CPU, refused outside the supported
range in one line (NGC's pre-release builds count as their release); the venv sees the environment's site
directories after its own; the check after the install (torch imports from the environment, its requirements hold,
what the lock shadows is named). The whole setup around a real torch: tests/integration/house/test_install.py."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from cluster import install
from cluster.lockfile import InstallError
from tests.conftest import ROOT

PYPROJECT = ROOT / "pyproject.toml"


def _environment(root: Path, version: str, cuda: str | None) -> Path:
    """A site directory holding a torch distribution (metadata and ``torch/version.py``, as a wheel installs them)."""
    site = root / "site-packages"
    (site / f"torch-{version}.dist-info").mkdir(parents=True)
    (site / f"torch-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
    )
    (site / "torch").mkdir()
    (site / "torch" / "version.py").write_text(
        f"from typing import Optional\n__version__ = '{version}'\ncuda: Optional[str] = {cuda!r}\n"
    )
    return site


def test_probe_reads_version_and_cuda_without_importing(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    cases = {
        "ngc": ("2.11.0a0+ecf3bae40a.nv26.01", "13.0"),
        "pypi": ("2.13.0", "13.0"),
        "cpu": ("2.12.1+cpu", None),
    }
    for name, (version, cuda) in cases.items():
        site = _environment(tmp_path / name, version, cuda)
        with monkeypatch.context() as m:
            m.syspath_prepend(str(site))
            found = install.probe(venv, PYPROJECT, auto=False)
            assert found == f"{version} {cuda or 'cpu'} {site}", found
            assert install.probe(venv, PYPROJECT, auto=True) == ("" if cuda is None else found)  # auto: CUDA only


def test_probe_refuses_a_torch_outside_the_range_or_none_in_one_line(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    with monkeypatch.context() as m:
        m.syspath_prepend(str(_environment(tmp_path / "old", "2.9.1+cu128", "12.8")))
        for auto in (False, True):  # a CUDA torch found automatically is held to the range too
            with pytest.raises(InstallError) as e:
                install.probe(venv, PYPROJECT, auto=auto)
            assert str(e.value) == (
                f"torch 2.9.1+cu128 in {sys.executable} is outside the supported range >=2.11,<2.14 (pyproject.toml "
                "[tool.pretrain] torch); PRETRAIN_TORCH=cuda|cpu installs the lock's torch"
            )
        with pytest.raises(InstallError, match=r"outside the supported range >=2\.11,<2\.14 \(pyproject.toml "):
            install.probe(venv, PYPROJECT, auto=False, offline=True)
    monkeypatch.setattr(importlib.metadata, "distribution", _missing)
    assert install.probe(venv, PYPROJECT, auto=True) == ""
    with pytest.raises(InstallError, match=r"^PRETRAIN_TORCH=system: .* has no torch; PYTHON=\.\.\. names the Python"):
        install.probe(venv, PYPROJECT, auto=False)
    with pytest.raises(InstallError, match=r"^setup --offline keeps the environment's torch, but .* has no torch"):
        install.probe(venv, PYPROJECT, auto=False, offline=True)
    with pytest.raises(InstallError, match="is this checkout's venv"):
        install.probe(Path(sys.prefix), PYPROJECT, auto=False)


def _missing(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_link_adds_the_environments_site_directories_after_the_venvs(tmp_path):
    venv = tmp_path / "venv"
    target = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    target.mkdir(parents=True)
    elsewhere = tmp_path / "from-pythonpath"
    elsewhere.mkdir()
    pth = install.link(venv, elsewhere)
    lines = pth.read_text().splitlines()
    assert pth == target / install.PTH and lines[-1] == f"import site; site.addsitedir({str(elsewhere)!r})"
    assert all(line.startswith("import site; site.addsitedir(") for line in lines)
    with pytest.raises(InstallError, match="not a venv of Python"):
        install.link(tmp_path / "nothing", elsewhere)


def test_verify_checks_where_torch_comes_from_and_what_it_requires(monkeypatch, tmp_path):
    import torch

    with pytest.raises(InstallError, match=r"^the venv has its own torch"):
        install.verify(torch.__version__, [])  # this venv's torch is its own
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # as if torch came from an environment outside this venv
    assert install.verify(torch.__version__, []).startswith(f"torch {torch.__version__} from the environment (")
    with pytest.raises(
        InstallError,
        match=rf"^the venv imports torch {re.escape(torch.__version__)}, setup saw 2\.11\.0 in the environment$",
    ):
        install.verify("2.11.0", [])
    requires = importlib.metadata.requires
    monkeypatch.setattr(
        importlib.metadata,
        "requires",
        lambda name: (
            ["sympy>=99", "nosuchpackage", 'optree>=0.13.0; extra == "optree"'] if name == "torch" else requires(name)
        ),
    )
    with pytest.raises(InstallError) as e:
        install.verify(torch.__version__, [])
    have = importlib.metadata.version("sympy")
    assert str(e.value) == (
        f"the environment's torch {torch.__version__} needs sympy>=99 (the venv sees {have}); "
        "nosuchpackage (not installed)"
    )


def test_verify_checks_every_requirement_of_what_setup_installed(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # torch from outside this venv, as above
    have = importlib.metadata.version("packaging")
    assert install.unmet_requirements([f"packaging=={have}", "pyyaml"]) == []
    assert install.unmet_requirements(["packaging>=999", "nosuchpackage==1.0"]) == [
        f"setup needs packaging>=999 (the venv sees {have})",
        "setup needs nosuchpackage==1.0 (not installed)",
    ]
    # transitively, with the extras asked for: a package's own requirement that is not met
    requires = importlib.metadata.requires
    fake = {"pyyaml": ["packaging>=999", 'nosuchpackage; extra == "more"', 'nosuchpackage; python_version < "3"']}
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: fake.get(name) or requires(name))
    yaml = importlib.metadata.version("pyyaml")
    assert install.unmet_requirements(["pyyaml"]) == [f"pyyaml {yaml} needs packaging>=999 (the venv sees {have})"]
    assert install.unmet_requirements(["pyyaml[more]"])[1] == f"pyyaml {yaml} needs nosuchpackage (not installed)"
    with pytest.raises(InstallError, match=r"^requirements not met in the venv: pyyaml .* needs packaging>=999"):
        install.verify(torch.__version__, ["pyyaml"])
    # what setup installed, with requirements.txt's extras, and torch
    installed = tmp_path / "installed.txt"
    installed.write_text("ray==2.60.0 \\\n    --hash=sha256:" + "ab" * 32 + "\nsix==1.17.0\n")
    roots = install.installed_roots(ROOT / "requirements.txt", installed)
    assert roots == ["torch", "ray[default,train]==2.60.0", "six==1.17.0"]


def test_command_line_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        install.main(["wheelhouse", "DIR", "--lock", "requirements.lock", "--uv", "uv", "--bogus"])
    assert e.value.code == 2 and capsys.readouterr().err == "[wheelhouse] error: unrecognized arguments: --bogus\n"
    assert install.main(["wheelhouse", "DIR", "--lock", "requirements.lock", "--uv", "uv", "--without", "mlflow"]) == 2
    assert capsys.readouterr().err == "[wheelhouse] error: --without mlflow: can leave out ray, dev (comma-separated)\n"
