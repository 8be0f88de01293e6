"""A wheelhouse for one environment (``./launch.sh wheelhouse DIR --environment FILE``): the packages
requirements.txt names at their exact pins, and of the rest only what the environment does not already have at a
version the resolution accepts. FILE is the environment's ``python -m pip list --format=freeze`` (or
``--format=json``) output. The resolution is ``uv pip compile`` for the target Python and platform, with the
environment's torch as a constraint and its other versions as preferences (uv keeps a preferred version wherever
every requirement on it allows it); what it picks at the environment's version is left to the environment, as are
torch and what only torch needs. Standard library only (it runs with whatever Python setup uses)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from cluster.lockfile import InstallError, Pin, canonical, left_out, optional_roots, parse_lock, uv_sources

UV_PLATFORM = {"x86_64": "x86_64-manylinux_{}", "aarch64": "aarch64-manylinux_{}"}


def read_environment(path: Path) -> dict[str, str]:
    """{canonical name: version} of ``pip list --format=freeze`` (``name==version`` lines; ``#`` comments, blank
    lines, and ``-e``/``name @ url`` lines, which name no index version, are skipped) or ``--format=json``."""
    try:
        text = path.read_text()
    except OSError as e:
        raise InstallError(f"--environment {path}: {e.strerror}") from None
    out: dict[str, str] = {}
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
            for row in rows:
                out[canonical(row["name"])] = str(row["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise InstallError(f"--environment {path}: not pip list --format=json output ({e})") from None
    else:
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line or line.startswith("-e ") or " @ " in line:
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=;]+)", line)
            if not m:
                raise InstallError(f"--environment {path}:{number}: expected NAME==VERSION (pip list --format=freeze)")
            out[canonical(m.group(1))] = m.group(2)
    if "torch" not in out:  # (either format)
        raise InstallError(f"--environment {path}: no torch (the wheelhouse installs around the environment's)")
    return out


def same_version(a: str, b: str) -> bool:
    """The same release, pre/post/dev part and local tag, up to case and trailing ``.0`` (``1.0`` is ``1.0.0``)."""

    def norm(v: str) -> tuple[str, str]:
        v = v.strip().lower().removeprefix("v")
        m = re.match(r"(\d+(?:\.\d+)*)(.*)$", v)
        if not m:
            return v, ""
        parts = m.group(1).split(".")
        while len(parts) > 1 and parts[-1].lstrip("0") == "":
            parts.pop()
        return ".".join(str(int(p)) for p in parts), m.group(2)

    return norm(a) == norm(b)


def direct_requirements(requirements: Path, without: list[str]) -> list[str]:
    """requirements.txt's lines (its exact pins), less those ``--without`` leaves out."""
    drop = optional_roots(without)
    lines = []
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        if name and canonical(name.group(0)) not in drop:
            lines.append(line)
    return lines


def split(pins: dict[str, Pin], env: dict[str, str], keep: set[str]) -> tuple[set[str], dict[str, str]]:
    """(what a wheelhouse leaves out: torch, what only torch needs, and every package the environment has at the
    resolved version; {name: version} of the packages left to the environment that the stack needs). ``keep``: the
    build backend, never left out for torch's sake."""
    torch_only = left_out(pins, {"torch"} & pins.keys(), keep)  # torch is resolved only where a package needs it
    have = {
        n: env[n] for n, pin in pins.items() if n not in torch_only and n in env and same_version(env[n], pin.version)
    }
    return torch_only | set(have), have


def resolve(
    direct: list[str], env: dict[str, str], build: list[str], python: str, platform: str, uv: str, work: Path
) -> str:
    """The per-environment lock (``uv pip compile --generate-hashes`` text): ``direct`` and the project's ``build``
    requirements for CPython ``python`` on ``platform``; torch constrained to the environment's release (its local
    tag, e.g. +cu130, is the environment's own build), every other package preferring the environment's version."""
    m = re.fullmatch(r"manylinux_(2_\d+)_(x86_64|aarch64)", platform)
    if not m:
        raise InstallError(f"--platform {platform}: expected manylinux_2_<glibc minor>_<x86_64|aarch64>")
    torch = re.sub(r"\+.*$", "", env["torch"])
    (work / "in.txt").write_text("\n".join([*direct, *build]) + "\n")
    (work / "constraints.txt").write_text(f"torch=={torch}\n")
    # uv reads an existing output file as its preferences: the environment's versions, as pins
    (work / "lock.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(env.items()) if n != "torch"))
    extra = uv_sources("lock")
    cmd = [
        uv,
        "pip",
        "compile",
        "-q",
        "--generate-hashes",
        "--python-version",
        python,
        "--python-platform",
        UV_PLATFORM[m.group(2)].format(m.group(1)),
        "--index-strategy",
        "unsafe-best-match",
        "--custom-compile-command",
        "./launch.sh wheelhouse DIR --environment FILE",
        "-c",
        str(work / "constraints.txt"),
        str(work / "in.txt"),
        "-o",
        str(work / "lock.txt"),
    ]
    proc = subprocess.run(cmd, env={**os.environ, "UV_PYTHON_DOWNLOADS": "never", **extra}, text=True)
    if proc.returncode != 0:
        raise InstallError("resolving for the environment failed (uv's output is above)", 1)
    text = (work / "lock.txt").read_text()
    return text.replace(str(work / "in.txt"), "requirements.txt").replace(
        f"-c {work / 'constraints.txt'}", f"-c the environment's torch {torch}"
    )


def environment_lock(
    env_file: Path, requirements: Path, without: list[str], build: list[str], python: str, platform: str, uv: str
) -> tuple[dict[str, str], list[str], dict[str, Pin]]:
    """(the environment, the lock's header, its pins) for ``env_file``: see ``resolve``."""
    env = read_environment(env_file)
    with tempfile.TemporaryDirectory() as tmp:
        text = resolve(direct_requirements(requirements, without), env, build, python, platform, uv, Path(tmp))
    header, pins = parse_lock(text)  # `# via -r requirements.txt`: asked for by name (the direct pins, the backend)
    return env, header, pins
