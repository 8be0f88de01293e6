"""The lock as data, for setup and the wheelhouse: its pins with their hashes and what needs each (the ``# via`` lines
``uv pip compile`` writes), what only a given package needs, the supported torch range, and pip's package sources for
uv. Standard library only (it runs with whatever Python setup uses, before anything is installed)."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = "-r"  # a `# via -r requirements.txt` parent: the package is asked for by name, never left out for a parent's sake


class InstallError(Exception):
    """A one-line error for the user (exit status in ``code``)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def canonical(name: str) -> str:
    """PEP 503 normalized name: ``Typing_Extensions`` -> ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", name).lower()


# -- the lock ----------------------------------------------------------------------------------------------------------


@dataclass
class Pin:
    """One package of a lock: its pin, the sha256 of every file the lock allows, what needs it, and its lines."""

    name: str
    version: str
    hashes: list[str] = field(default_factory=list)
    via: set[str] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)


def parse_lock(text: str) -> tuple[list[str], dict[str, Pin]]:
    """The header comment lines and the pins of a ``uv pip compile --generate-hashes`` lock, in file order."""
    header: list[str] = []
    pins: dict[str, Pin] = {}
    pin: Pin | None = None
    in_via = False
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)", line)
        if m:
            pin = Pin(canonical(m.group(1)), m.group(3), lines=[line])
            pins[pin.name] = pin
            in_via = False
            continue
        if pin is None:
            header.append(line)
            continue
        pin.lines.append(line)
        stripped = line.strip()
        if h := re.search(r"--hash=sha256:([0-9a-f]{64})", stripped):
            pin.hashes.append(h.group(1))
        elif stripped.startswith("# via"):
            rest = stripped.removeprefix("# via").strip()
            in_via = not rest
            if rest:
                pin.via |= _parent(rest)
        elif in_via and stripped.startswith("#   "):
            pin.via |= _parent(stripped.removeprefix("#").strip())
        else:
            in_via = False
    return header, pins


def _parent(text: str) -> set[str]:
    """``-r requirements.txt``: asked for by name; ``-c FILE``: a constraint (a version, not a need), no parent;
    anything else names a package."""
    if text.startswith("-c"):
        return set()
    return {TOP} if text.startswith("-r") else {canonical(text.split()[0])}


def left_out(pins: dict[str, Pin], roots: set[str], keep: set[str]) -> set[str]:
    """``roots`` and every package only they need, transitively (the lock's ``# via``); ``keep`` (e.g. the build
    backend) and packages asked for by name stay. A package the lock names no parent for is kept."""
    unknown = roots - pins.keys()
    if unknown:
        raise InstallError(f"{', '.join(sorted(unknown))}: not in the lock")
    out = set(roots)
    grew = True
    while grew:
        grew = False
        for name, pin in pins.items():
            if name in out or name in keep or not pin.via or TOP in pin.via:
                continue
            if pin.via <= out:
                out.add(name)
                grew = True
    return out


def lock_text(header: list[str], pins: dict[str, Pin], drop: set[str], hashes: dict[str, str]) -> str:
    """The lock without ``drop``; ``hashes`` replaces a package's hashes by one (a wheel built from its sdist)."""
    lines = list(header)
    for pin in pins.values():
        if pin.name in drop:
            continue
        if pin.name in hashes:
            lines += [pin.lines[0].split(" \\")[0] + " \\", f"    --hash=sha256:{hashes[pin.name]}"]
            lines += [ln for ln in pin.lines[1:] if "--hash=" not in ln]
        else:
            lines += pin.lines
    return "\n".join(lines) + "\n"


def build_requires(pyproject: Path) -> set[str]:
    """The project's build backend (``[build-system] requires``): setup builds the project with the venv's copy."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())
    return {canonical(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in project["build-system"]["requires"]}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# -- the supported torch -----------------------------------------------------------------------------------------------


def torch_range(pyproject: Path) -> str:
    """The torch versions an environment may bring (``[tool.pretrain] torch`` in pyproject.toml)."""
    import tomllib

    return str(tomllib.loads(pyproject.read_text())["tool"]["pretrain"]["torch"])


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version: a pre-release or local build counts as its release (NGC's
    ``2.11.0a0+git...nv26.01`` is 2.11.0, ``2.13.0+cu130`` is 2.13.0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise InstallError(f"torch version {version!r}: not a version number")
    return tuple(int(p) for p in m.group(1).split("."))


def in_range(version: str, spec: str) -> bool:
    """``version`` (its release numbers) satisfies every clause of ``spec`` (``>=2.11,<2.14``: ``>= > <= < == !=``)."""
    have = release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)", clause)
        if not m:
            raise InstallError(f"pyproject.toml [tool.pretrain] torch: cannot read {clause!r} (e.g. '>=2.11,<2.14')")
        want = tuple(int(p) for p in m.group(2).split("."))
        width = max(len(have), len(want))
        a, b = have + (0,) * (width - len(have)), want + (0,) * (width - len(want))
        ok = {">=": a >= b, "<=": a <= b, "==": a == b, "!=": a != b, ">": a > b, "<": a < b}[m.group(1)]
        if not ok:
            return False
    return True


# -- what --without leaves out -----------------------------------------------------------------------------------------

# What `--without NAME` leaves out (each with what only it needs); each is a package requirements.txt asks for.
OPTIONAL = {
    "ray": {"ray"},  # Ray Train and the Jobs API: not needed with cluster.use_ray=false (one process or torchrun)
    # lint and tests
    "dev": {"ruff", "mypy", "pytest", "pytest-xdist", "hypothesis", "pre-commit", "import-linter", "types-pyyaml"},
}


def optional_roots(names: list[str]) -> set[str]:
    roots: set[str] = set()
    for name in names:
        if name not in OPTIONAL:
            raise InstallError(f"--without {name}: can leave out {', '.join(OPTIONAL)} (comma-separated)")
        roots |= OPTIONAL[name]
    return roots


# -- pip's package sources, for uv -------------------------------------------------------------------------------------


def uv_sources(kind: str) -> dict[str, str]:
    """uv reads no pip configuration: the package sources pip uses here (pip.conf files, PIP_* variables) as uv's
    environment variables (``UV_INDEX_URL``, ``UV_EXTRA_INDEX_URL`` space-separated, ``UV_FIND_LINKS``
    comma-separated: never uv's command line, which any local user can read, with an index's credentials in it),
    and pip's CA bundle as ``SSL_CERT_FILE`` (where it is not set). ``lock`` leaves out extra indexes (local
    mirrors), so that the lock records the main index's hashes of every file; find-links stays (this machine's CPU
    torch wheel). The cuda kinds leave out find-links: torch==X also matches a local X+cpu wheel there, and the
    CUDA lock wants the index's default build. Nothing when UV_* sources are set."""
    import ast
    import subprocess

    if any(
        os.environ.get(v)
        for v in ("UV_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS")
    ):
        return {}
    text = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    conf = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        try:
            conf[key] = ast.literal_eval(value)
        except (SyntaxError, ValueError):
            pass

    def get(name: str) -> list[str]:  # pip's precedence: PIP_* variables, then [install], then [global]
        for section in (":env:", "install", "global"):
            if f"{section}.{name}" in conf:
                return str(conf[f"{section}.{name}"]).split()
        return []

    names = {
        "all": ["index-url", "find-links", "extra-index-url"],
        "lock": ["index-url", "find-links"],
        "cuda": ["index-url", "extra-index-url"],
        "cuda-lock": ["index-url"],
    }[kind]
    variables = {"index-url": ("UV_INDEX_URL", " "), "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
                 "find-links": ("UV_FIND_LINKS", ",")}  # fmt: skip
    env = {variables[name][0]: variables[name][1].join(get(name)) for name in names if get(name)}
    if "UV_INDEX_URL" in env:  # pip takes one index URL (the last given wins there too)
        env["UV_INDEX_URL"] = env["UV_INDEX_URL"].split()[-1]
    cert = get("cert")[:1]
    if cert and not os.environ.get("SSL_CERT_FILE"):
        env["SSL_CERT_FILE"] = cert[0]
    return env
