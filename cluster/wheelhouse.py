"""``./launch.sh wheelhouse DIR``: every wheel setup needs around an environment's torch, for a target Python and
platform, in one directory with a manifest; and what ``./launch.sh setup --offline DIR`` installs from it. Standard
library only; pip downloads (hash-checked), uv builds the sdists (once, into pure-Python wheels)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from cluster.environment import environment_lock, same_version, split
from cluster.lockfile import (
    ROOT,
    TOP,
    InstallError,
    Pin,
    build_requires,
    canonical,
    left_out,
    lock_text,
    optional_roots,
    parse_lock,
    sha256,
    uv_sources,
)

MANIFEST = "wheelhouse.json"


def platforms(tag: str) -> list[str]:
    """``manylinux_2_28_x86_64`` -> the tags a wheel for that glibc may carry: 2_28 down to 2_5 and the legacy
    aliases (pip matches ``--platform`` exactly and would miss a ``manylinux2014`` wheel otherwise)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(x86_64|aarch64)", tag)
    if not m:
        raise InstallError(f"--platform {tag}: expected manylinux_2_<glibc minor>_<x86_64|aarch64>")
    minor, arch = int(m.group(1)), m.group(2)
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out = []
    for v in range(minor, 4, -1):
        out.append(f"manylinux_2_{v}_{arch}")
        if v in legacy:
            out.append(f"{legacy[v]}_{arch}")
    return out


def wheel_name(filename: str) -> tuple[str, str]:
    """(canonical name, version) of a wheel or sdist file name."""
    stem = re.sub(r"(\.whl|\.tar\.gz|\.zip)$", "", filename)
    name, version = re.match(r"^(.+?)-(\d[^-]*)", stem).groups()  # type: ignore[union-attr]
    return canonical(name), version


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    import subprocess

    if subprocess.run(cmd, env={**os.environ, **(env or {})}).returncode != 0:
        raise InstallError(f"{what} failed (its output is above)", 1)


def wheelhouse(args: argparse.Namespace) -> None:
    """Every wheel the lock needs, less torch and what only it needs (the environment brings them) and ``--without``,
    for CPython ``--python`` on ``--platform``: downloaded hash-checked by pip; an sdist (DeepSpeed ships one) built
    here once into a wheel, which must be pure Python. Writes the wheels, ``requirements.txt`` (what setup installs
    from them, hash-checked) and ``wheelhouse.json`` (the manifest: lock, target, sizes, sha256) into DIR. With
    ``--environment FILE`` (the target's ``pip list``): the lock's direct pins and, of the rest, only what that
    environment lacks at a version they accept (``cluster.environment``); ``requirements.txt`` is then that
    resolution less what the environment brings, and the manifest names the environment and what it leaves to it."""
    import shutil
    import tempfile

    out = Path(args.dir).absolute()
    if not re.fullmatch(r"3\.\d+", args.python) or int(args.python.split(".")[1]) < 11:
        raise InstallError(f"--python {args.python}: expected 3.11 or later, as X.Y")
    tags = platforms(args.platform)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise InstallError(f"{out} exists and is not a wheelhouse (no {MANIFEST}): name a new or empty directory")
    if out.is_dir() and (out / MANIFEST).is_file():
        _only_its_own_files(out)
    lock = Path(args.lock)
    header, pins = parse_lock(lock.read_text())
    without = sorted({w for w in args.without.split(",") if w})
    keep = build_requires(ROOT / "pyproject.toml")
    drop = left_out(pins, {"torch"} | optional_roots(without), keep)
    env: dict | None = None
    if getattr(args, "environment", None):
        environment, _, pins = environment_lock(
            Path(args.environment),
            lock.parent / "requirements.txt",
            without,
            [*_build_requirements(ROOT / "pyproject.toml"), "packaging"],  # packaging: setup's check (install.py)
            args.python,
            args.platform,
            args.uv,
        )
        drop, have = split(pins, environment, keep)
        env = {
            "file": Path(args.environment).name,
            "sha256": sha256(Path(args.environment)),
            "torch": environment["torch"],
            "left_to_environment": dict(sorted(have.items())),
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        (stage / "download.txt").write_text(lock_text([], pins, drop, {}))
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-qq",
                "--disable-pip-version-check",
                "--no-deps",
                "--require-hashes",
                "--dest",
                str(stage / "files"),
                "--python-version",
                args.python,
                "--implementation",
                "cp",
                "--abi",
                "cp" + args.python.replace(".", ""),
                *(f"--platform={t}" for t in tags),
                "-r",
                str(stage / "download.txt"),
            ],
            "pip download",
        )
        built = _build_sdists(stage / "files", lock, args)
        files = sorted((stage / "files").iterdir())
        manifest = _manifest(files, pins, drop, built, lock, args, without)
        if env is not None:
            manifest["environment"] = env
            what = (
                f"requirements.txt's pins (those of {lock.name}, sha256 {manifest['lock_sha256']}) resolved for the "
                f"environment of {env['file']} (sha256 {env['sha256']}), less torch and what the environment has "
                f"at the version resolved ({len(drop)} packages: wheelhouse.json)"
            )
        else:
            what = f"{lock.name} (sha256 {manifest['lock_sha256']}) less {', '.join(sorted(drop))}"
        (stage / "files" / "requirements.txt").write_text(
            lock_text(
                [
                    f"# What ./launch.sh setup --offline installs from this wheelhouse, hash-checked: {what}; a "
                    "package pinned as an sdist has the hash of the wheel built from it here (wheelhouse.json: "
                    "built_from)"
                ],
                pins,
                drop,
                {f["name"]: f["sha256"] for f in manifest["files"] if "built_from" in f},
            )
        )
        (stage / "files" / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            out.rename(stage / "old")  # a wheelhouse made before: replaced whole, removed with the stage
        (stage / "files").rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    _report(manifest, out)


def _only_its_own_files(out: Path) -> None:
    """Refuse to rebuild the wheelhouse ``out`` (replaced whole) when it holds anything its manifest does not list:
    a file put there by hand would go with it."""
    try:
        listed = {f["file"] for f in json.loads((out / MANIFEST).read_text())["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        raise InstallError(
            f"{out / MANIFEST} cannot be read as a wheelhouse manifest: name a new or empty directory"
        ) from None
    extra = sorted(p.name for p in out.iterdir() if p.name not in listed | {MANIFEST, "requirements.txt"})
    if extra:
        shown = ", ".join(extra[:3]) + (", ..." if len(extra) > 3 else "")
        raise InstallError(
            f"{out} holds files its {MANIFEST} does not list ({shown}), "
            "which a rebuild would remove: move them out, or name a new directory"
        )


def _build_requirements(pyproject: Path) -> list[str]:
    """``[build-system] requires`` as written (``setuptools>=80``): setup builds the project without isolation."""
    import tomllib

    return [str(r) for r in tomllib.loads(pyproject.read_text())["build-system"]["requires"]]


def _build_sdists(files: Path, lock: Path, args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Build each downloaded sdist (hash-checked by pip against the lock) into a pure-Python wheel, with the lock's
    build backend (uv, hash-checked build requirements); the sdist is replaced by the wheel."""
    import tempfile

    built: dict[str, dict[str, str]] = {}
    for sdist in sorted(p for p in files.iterdir() if not p.name.endswith(".whl")):
        name, version = wheel_name(sdist.name)
        with tempfile.TemporaryDirectory(dir=files.parent) as tmp:
            env = uv_sources("all")
            _run(
                [
                    args.uv,
                    "build",
                    "-q",
                    "--wheel",
                    "--python",
                    sys.executable,
                    "--build-constraints",
                    str(lock),
                    "--require-hashes",
                    "--index-strategy",
                    "unsafe-best-match",
                    "--out-dir",
                    tmp,
                    str(sdist),
                ],
                f"building {sdist.name}",
                {"UV_PYTHON_DOWNLOADS": "never", **env},
            )
            (wheel,) = Path(tmp).glob("*.whl")
            if not wheel.name.endswith("-none-any.whl"):
                raise InstallError(
                    f"{name} {version} has no wheel for CPython {args.python} on {args.platform}, and its sdist builds "
                    f"a platform wheel ({wheel.name}): make the wheelhouse on the target's Python and platform",
                    1,
                )
            built[name] = {"file": sdist.name, "sha256": sha256(sdist)}
            wheel.rename(files / wheel.name)
        sdist.unlink()
    return built


def _manifest(
    files: list[Path],
    pins: dict[str, Pin],
    drop: set[str],
    built: dict[str, dict[str, str]],
    lock: Path,
    args: argparse.Namespace,
    without: list[str],
) -> dict:
    """One file per package the wheelhouse installs, each checked against the lock (a built wheel: its sdist)."""
    want = {n for n in pins if n not in drop}
    entries = []
    for f in files:
        name, version = wheel_name(f.name)
        pin = pins.get(name)
        digest = sha256(f)
        source = built.get(name, {}).get("sha256", digest)
        if pin is None or name not in want or pin.version != version or source not in pin.hashes:
            raise InstallError(f"{f.name}: not a file of the lock's {name} (version or sha256 differs)", 1)
        entry: dict = {"name": name, "version": version, "file": f.name, "bytes": f.stat().st_size, "sha256": digest}
        if name in built:
            entry["built_from"] = built[name]
        entries.append(entry)
    missing = want - {e["name"] for e in entries}
    if missing or len(entries) != len(want):
        raise InstallError(f"the download is missing {', '.join(sorted(missing))} (or holds two files of one)", 1)
    size = {e["name"]: e["bytes"] for e in entries}
    keep = build_requires(ROOT / "pyproject.toml")
    asked = [n for n, pin in pins.items() if n in want and (TOP in pin.via or not pin.via)]  # uv: the installer
    weighs = {t: sum(size[n] for n in left_out(pins, drop | {t}, keep) - drop) for t in asked}
    return {
        "lock": lock.name,
        "lock_sha256": sha256(lock),
        "python": args.python,
        "platform": args.platform,
        "without": without,
        "left_out": sorted(drop),
        "bytes": sum(e["bytes"] for e in entries),
        "files": sorted(entries, key=lambda e: -e["bytes"]),
        # each package requirements.txt asks for: its bytes and those of every package only it needs
        "by_requirement": dict(sorted(weighs.items(), key=lambda kv: -kv[1])),
    }


def _report(manifest: dict, out: Path, top: int = 15) -> None:
    mib = 1 << 20
    files = manifest["files"]
    print(f"[wheelhouse] {len(files)} wheels for CPython {manifest['python']} on {manifest['platform']} in {out}")
    for f in files[:top]:
        print(f"  {f['bytes'] / mib:7.1f} MiB  {f['file']}" + ("  (built from its sdist)" if "built_from" in f else ""))
    rest = files[top:]
    if rest:
        print(f"  {sum(f['bytes'] for f in rest) / mib:7.1f} MiB  the other {len(rest)} wheels")
    print(f"  {manifest['bytes'] / mib:7.1f} MiB  in all (manifest with every size and sha256: {out / MANIFEST})")
    weighs = manifest["by_requirement"]
    shared = manifest["bytes"] - sum(weighs.values())
    print(
        "[wheelhouse] by requirement, each with what only it needs: "
        + ", ".join(f"{n} {b / mib:.1f}" for n, b in list(weighs.items())[:top] if b >= mib / 10)
        + f"; needed by several: {shared / mib:.1f} MiB"
    )
    env = manifest.get("environment")
    if env:
        have = env["left_to_environment"]
        print(
            f"[wheelhouse] left to the environment of {env['file']}: torch {env['torch']} and what only it needs, and "
            f"{len(have)} packages it has at the version resolved: " + ", ".join(f"{n} {v}" for n, v in have.items())
        )
    else:
        print(
            f"[wheelhouse] left out: {', '.join(manifest['left_out'])} (the environment's torch and what only it needs"
            + (f"; --without {','.join(manifest['without'])}" if manifest["without"] else "")
            + ")"
        )
    print(f"[wheelhouse] install it offline: ./launch.sh setup --offline {out}")


# -- installing from it ------------------------------------------------------------------------------------------------


def install_requirements(lock: Path, wheels: Path | None) -> tuple[str, str]:
    """(what setup installs around the environment's torch, a one-line note of what it leaves out): the lock less
    torch and what only torch needs; from a wheelhouse, also less its ``--without``, with its built wheels' hashes
    (each checked to come from the sdist the lock pins)."""
    header, pins = parse_lock(lock.read_text())
    keep = build_requires(ROOT / "pyproject.toml")
    if wheels is None:
        drop = left_out(pins, {"torch"}, keep)
        names = ", ".join(sorted(drop))
        title = [f"# What ./launch.sh setup installs around the environment's torch: {lock.name} less {names}"]
        return lock_text(title, pins, drop, {}), f"left to the environment: {names}"
    if not (wheels / MANIFEST).is_file():  # gone since the venv was set up from it (its stamp names it)
        raise InstallError(
            f"{wheels}: no wheelhouse here any more ({MANIFEST}); ./launch.sh setup --offline DIR names "
            "another, or rm -r .venv to set up online"
        )
    manifest = json.loads((wheels / MANIFEST).read_text())
    if manifest["lock_sha256"] != sha256(lock):
        raise InstallError(
            f"{wheels} was made from another {manifest['lock']} than this checkout's: "
            f"./launch.sh wheelhouse {wheels} (where the package index is reachable)"
        )
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != here:
        raise InstallError(
            f"{wheels} holds wheels for Python {manifest['python']}; {sys.executable} is {here} "
            f"(./launch.sh wheelhouse DIR --python {here})"
        )
    _check_platform(manifest["platform"], wheels)
    if "environment" in manifest:
        return _environment_requirements(wheels, manifest)
    drop = left_out(pins, {"torch"} | optional_roots(manifest["without"]), keep)
    hashes = {}
    for f in manifest["files"]:
        if "built_from" in f:
            if f["built_from"]["sha256"] not in pins[f["name"]].hashes:
                raise InstallError(f"{wheels / f['file']}: built from an sdist that is not the lock's", 1)
            hashes[f["name"]] = f["sha256"]
    torch_only = left_out(pins, {"torch"}, keep)
    note = f"left to the environment: {', '.join(sorted(torch_only))}"
    if drop - torch_only:
        note += (
            f"; not in the wheelhouse (--without {','.join(manifest['without'])}): {len(drop - torch_only)} packages"
        )
    title = [f"# What ./launch.sh setup --offline installs from {wheels}: {lock.name} less {', '.join(sorted(drop))}"]
    return lock_text(title, pins, drop, hashes), note


def _environment_requirements(wheels: Path, manifest: dict) -> tuple[str, str]:
    """A wheelhouse made for one environment: its own lock, once this Python is checked to have every package the
    wheelhouse leaves to it, at the version it was resolved with (and torch at the same release)."""
    import importlib.metadata

    env = manifest["environment"]
    want = {"torch": env["torch"], **env["left_to_environment"]}
    wrong = []
    for name, version in want.items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = "none"
        if name == "torch":  # the release: a local tag (+cu130) names the environment's own build
            have, version = re.sub(r"\+.*", "", have), re.sub(r"\+.*", "", version)
        if not same_version(have, version):
            wrong.append(f"{name} {version} ({sys.executable} has {have})")
    if wrong:
        more = f" and {len(wrong) - 6} more" if len(wrong) > 6 else ""
        raise InstallError(
            f"{wheels} was made for another environment ({env['file']}), it leaves to it {', '.join(wrong[:6])}{more}: "
            f"./launch.sh wheelhouse DIR --environment FILE, FILE from '{sys.executable} -m pip list --format=freeze'"
        )
    note = (
        f"left to the environment: torch {env['torch']} and what only it needs, and {len(env['left_to_environment'])} "
        f"packages it has at the version {wheels} was resolved with"
    )
    return (wheels / "requirements.txt").read_text(), note


def _check_platform(tag: str, wheels: Path) -> None:
    import platform

    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
    glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "") if hasattr(os, "confstr") else ""
    have = re.fullmatch(r"glibc 2\.(\d+)", glibc)
    if m and (platform.machine() != m.group(2) or (have and int(have.group(1)) < int(m.group(1)))):
        raise InstallError(
            f"{wheels} holds wheels for {tag}; this machine is {platform.machine()} with "
            f"{glibc or 'no glibc'} (./launch.sh wheelhouse DIR --platform ...)"
        )
