"""The wheelhouse's checks that need no network: the platform tags pip is given, the refusals before a download,
the manifest that admits only the lock's files, and what ``setup --offline`` installs from a wheelhouse (the lock
less torch and its ``--without``, the built wheel's hash in place of the sdist's, refused when the wheelhouse is
another lock's, Python's or platform's). A real wheelhouse, built and installed with the network blocked:
tests/integration/house/test_install.py."""

from __future__ import annotations

import argparse
import json
import platform
import sys

import pytest

from cluster import wheelhouse as wh
from cluster.lockfile import InstallError, parse_lock, sha256
from tests.conftest import ROOT

LOCK = ROOT / "requirements.lock"
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def test_platform_tags_reach_down_to_the_oldest_manylinux():
    tags = wh.platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64"} <= set(tags)
    assert "manylinux2014_aarch64" in wh.platforms("manylinux_2_28_aarch64")
    for bad in ("linux_x86_64", "manylinux2014_x86_64", "manylinux_2_28_ppc64le"):
        with pytest.raises(InstallError, match=f"--platform {bad}: expected manylinux_2_<glibc minor>_"):
            wh.platforms(bad)
    assert wh.wheel_name("typing_extensions-4.16.0-py3-none-any.whl") == ("typing-extensions", "4.16.0")
    assert wh.wheel_name("deepspeed-0.19.8.tar.gz") == ("deepspeed", "0.19.8")


def _args(tmp_path, **changes) -> argparse.Namespace:
    args = dict(dir=str(tmp_path / "wh"), lock=str(LOCK), uv="uv", python=HERE, platform="manylinux_2_28_x86_64")
    return argparse.Namespace(**{**args, "without": "", **changes})


def test_wheelhouse_refuses_bad_input_before_downloading(tmp_path):
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "notes.txt").write_text("mine")
    with pytest.raises(InstallError, match=r"wh exists and is not a wheelhouse \(no wheelhouse.json\): name a new"):
        wh.wheelhouse(_args(tmp_path))
    assert (tmp_path / "wh" / "notes.txt").read_text() == "mine"
    # a wheelhouse made before is replaced whole: a file its manifest does not list is never removed with it
    (tmp_path / "wh" / wh.MANIFEST).write_text(
        json.dumps({"files": [{"name": "six", "file": "six-1.17.0-py2.py3-none-any.whl"}]})
    )
    (tmp_path / "wh" / "six-1.17.0-py2.py3-none-any.whl").write_bytes(b"")
    with pytest.raises(InstallError, match=r"wh holds files its wheelhouse.json does not list \(notes.txt\)"):
        wh.wheelhouse(_args(tmp_path))
    (tmp_path / "wh" / wh.MANIFEST).write_text("{")
    with pytest.raises(InstallError, match=r"wheelhouse.json cannot be read as a wheelhouse manifest"):
        wh.wheelhouse(_args(tmp_path))
    assert (tmp_path / "wh" / "notes.txt").read_text() == "mine"
    for python in ("3.10", "3", "3.12.1"):
        with pytest.raises(InstallError, match=f"--python {python}: expected 3.11 or later, as X.Y"):
            wh.wheelhouse(_args(tmp_path, dir=str(tmp_path / "new"), python=python))
    with pytest.raises(InstallError, match="--without torch: can leave out ray, dev"):
        wh.wheelhouse(_args(tmp_path, dir=str(tmp_path / "new"), without="ray,torch"))
    assert not (tmp_path / "new").exists()


def test_the_manifest_admits_only_the_locks_files(tmp_path):
    _, pins = parse_lock(LOCK.read_text())
    wheel = tmp_path / "six-1.17.0-py2.py3-none-any.whl"
    wheel.write_bytes(b"not the lock's six")
    args = _args(tmp_path)
    drop = set(pins) - {"six"}
    with pytest.raises(InstallError, match="six-1.17.0-py2.py3-none-any.whl: not a file of the lock's six"):
        wh._manifest([wheel], pins, drop, {}, LOCK, args, [])
    # A wheel built from the lock's sdist: its own sha256 is recorded, the sdist's is checked against the lock.
    built = {"six": {"file": "six-1.17.0.tar.gz", "sha256": pins["six"].hashes[0]}}
    manifest = wh._manifest([wheel], pins, drop, built, LOCK, args, [])
    (entry,) = manifest["files"]
    assert entry == {
        "name": "six",
        "version": "1.17.0",
        "file": wheel.name,
        "bytes": wheel.stat().st_size,
        "sha256": sha256(wheel),
        "built_from": built["six"],
    }
    assert manifest["lock_sha256"] == sha256(LOCK) and manifest["bytes"] == wheel.stat().st_size
    with pytest.raises(InstallError, match="the download is missing packaging, six"):
        wh._manifest([], pins, drop - {"packaging"}, {}, LOCK, args, [])


def _wheelhouse(tmp_path, **changes):
    """A manifest as ``wheelhouse --without ray`` writes it, with DeepSpeed's wheel built from the lock's sdist."""
    _, pins = parse_lock(LOCK.read_text())
    built = {"file": "deepspeed-0.19.8.tar.gz", "sha256": pins["deepspeed"].hashes[0]}
    manifest = {
        "lock": "requirements.lock",
        "lock_sha256": sha256(LOCK),
        "python": HERE,
        "platform": f"manylinux_2_17_{platform.machine()}",
        "without": ["ray"],
        "left_out": [],
        "bytes": 1,
        "files": [{"name": "deepspeed", "sha256": "ab" * 32, "file": "deepspeed.whl", "built_from": built}],
    }
    manifest.update(changes)
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / wh.MANIFEST).write_text(json.dumps(manifest))
    return tmp_path


def test_offline_installs_the_lock_less_torch_and_the_wheelhouses_without(tmp_path):
    text, note = wh.install_requirements(LOCK, _wheelhouse(tmp_path))
    _, pins = parse_lock(text)
    _, full = parse_lock(LOCK.read_text())
    assert not {"torch", "sympy", "ray", "colorful", "py-spy"} & set(pins)
    assert {"filelock", "jinja2", "setuptools", "aiohttp", "uv"} <= set(pins)
    assert pins["deepspeed"].hashes == ["ab" * 32]  # the built wheel's, in place of the sdist's
    assert all(pins[n].hashes == full[n].hashes for n in pins if n != "deepspeed")
    assert note.startswith("left to the environment: mpmath, networkx, sympy, torch; not in the wheelhouse (--without")
    online, note = wh.install_requirements(LOCK, None)
    assert note == "left to the environment: mpmath, networkx, sympy, torch"
    assert set(parse_lock(online)[1]) == set(full) - {"torch", "sympy", "mpmath", "networkx"}


def test_offline_refuses_a_wheelhouse_of_another_lock_python_or_platform(tmp_path):
    cases = [
        ({"lock_sha256": "0" * 64}, "was made from another requirements.lock than this checkout's"),
        ({"python": "3.99"}, f"holds wheels for Python 3.99; {sys.executable} is {HERE}"),
        ({"platform": "manylinux_2_17_sparc"}, "holds wheels for manylinux_2_17_sparc; this machine is"),
        ({"platform": f"manylinux_2_999_{platform.machine()}"}, "holds wheels for manylinux_2_999"),
    ]
    for i, (changes, message) in enumerate(cases):
        with pytest.raises(InstallError, match=message):
            wh.install_requirements(LOCK, _wheelhouse(tmp_path / str(i), **changes))
    with pytest.raises(InstallError, match=r"gone: no wheelhouse here any more \(wheelhouse.json\)"):
        wh.install_requirements(LOCK, tmp_path / "gone")  # the one a venv's stamp names, deleted since
    other = {"file": "deepspeed-0.19.8.tar.gz", "sha256": "cd" * 32}
    files = [{"name": "deepspeed", "sha256": "ab" * 32, "file": "deepspeed.whl", "built_from": other}]
    with pytest.raises(InstallError, match="built from an sdist that is not the lock's"):
        wh.install_requirements(LOCK, _wheelhouse(tmp_path / "sdist", files=files))


def test_a_wheelhouse_for_one_environment_installs_its_own_lock_where_that_environment_is(tmp_path):
    import importlib.metadata

    torch = importlib.metadata.version("torch")
    packaging = importlib.metadata.version("packaging")
    env = {"file": "gpu.txt", "sha256": "0" * 64, "torch": torch, "left_to_environment": {"packaging": packaging}}
    wheels = _wheelhouse(tmp_path / "here", environment=env)
    (wheels / "requirements.txt").write_text("six==1.17.0 \\\n    --hash=sha256:" + "ab" * 32 + "\n")
    text, note = wh.install_requirements(LOCK, wheels)
    assert text == (wheels / "requirements.txt").read_text()
    assert note == f"left to the environment: torch {torch} and what only it needs, and 1 packages it has at the " + (
        f"version {wheels} was resolved with"
    )
    # another environment: a package the wheelhouse leaves to it missing, another at a different version, torch at
    # another release (its local tag alone may differ)
    local = {**env, "torch": torch.split("+")[0] + "+cu130"}
    (_wheelhouse(tmp_path / "local", environment=local) / "requirements.txt").write_text("")
    assert wh.install_requirements(LOCK, tmp_path / "local")[0] == ""
    other = {**env, "torch": "2.99.0", "left_to_environment": {"packaging": "0.1", "no-such-package": "1.0"}}
    with pytest.raises(InstallError) as e:
        wh.install_requirements(LOCK, _wheelhouse(tmp_path / "other", environment=other))
    assert str(e.value) == (
        f"{tmp_path / 'other'} was made for another environment (gpu.txt), it leaves to it torch 2.99.0 "
        f"({sys.executable} has {torch.split('+')[0]}), packaging 0.1 ({sys.executable} has {packaging}), "
        f"no-such-package 1.0 ({sys.executable} has none): ./launch.sh wheelhouse DIR --environment FILE, FILE from "
        f"'{sys.executable} -m pip list --format=freeze'"
    )
