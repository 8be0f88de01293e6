"""Installing the locked stack around an environment's torch, and offline from a wheelhouse: the Python half of
``./launch.sh setup`` (``PRETRAIN_TORCH=system``, ``--offline DIR``) and ``./launch.sh wheelhouse``.

Standard library only: launch.sh runs it with the Python that setup uses, before anything is installed
(``python cluster/install.py COMMAND ...``, the checkout first on PYTHONPATH as launch.sh exports it; ``verify`` runs
in the new venv, which sees ``packaging``: the lock's, or a wheelhouse's, or the environment's). Errors are one line
on stderr and exit 2 (bad input, nothing changed) or 1 (an install that does not hold).

The environment's torch is read from its metadata (no import) and must lie in ``[tool.pretrain] torch`` of
pyproject.toml; the venv sees the environment's packages after its own, through a ``.pth`` file; setup installs the
lock less torch and what only torch needs (``cluster.lockfile``; from a wheelhouse made for the environment, that
wheelhouse's own lock), then checks here that torch imports from the environment and that every requirement of
torch and of what setup installed, transitively, is met by the version the venv sees.
"""

from __future__ import annotations

import argparse
import os
import re
import site
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from cluster.lockfile import OPTIONAL, ROOT, InstallError, canonical, in_range, torch_range, uv_sources
from cluster.wheelhouse import install_requirements, wheelhouse

PTH = "_pretrain_environment.pth"  # in the venv's site-packages: the environment's site directories, after the venv's


# -- the environment's torch (run with the Python setup uses) ----------------------------------------------------------


def probe(venv: Path, pyproject: Path, auto: bool, offline: bool = False) -> str:
    """``VERSION CUDA SITE_DIR`` of this Python's torch (CUDA ``cpu`` for a CPU build), read from its metadata and
    ``torch/version.py`` without importing it; refused in one line when torch is missing or outside the supported
    range. ``auto``: an empty answer instead of an error, unless a CUDA torch is present (then it must be in range)."""
    import importlib.metadata

    why = "setup --offline keeps the environment's torch, but" if offline else "PRETRAIN_TORCH=system:"
    if Path(sys.prefix).resolve() == venv.resolve():
        if auto:
            return ""
        raise InstallError(
            f"{why} {sys.executable} is this checkout's venv; PYTHON=... names the Python whose torch to keep"
        )
    try:
        dist = importlib.metadata.distribution("torch")
    except importlib.metadata.PackageNotFoundError:
        if auto:
            return ""
        hint = "" if offline else " (or PRETRAIN_TORCH=cuda|cpu installs the lock's)"
        raise InstallError(
            f"{why} {sys.executable} has no torch; PYTHON=... names the Python that has it{hint}"
        ) from None
    version = dist.version
    where = Path(str(dist.locate_file("torch")))
    text = (where / "version.py").read_text() if (where / "version.py").is_file() else ""
    m = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    cuda = m.group(1) if m else "cpu"
    if auto and cuda == "cpu":
        return ""
    spec = torch_range(pyproject)
    if not in_range(version, spec):
        raise InstallError(
            f"torch {version} in {sys.executable} is outside the supported range {spec} "
            "(pyproject.toml [tool.pretrain] torch)"
            + ("" if offline else "; PRETRAIN_TORCH=cuda|cpu installs the lock's torch")
        )
    return f"{version} {cuda} {where.parent}"


def site_dirs(torch_dir: Path) -> list[str]:
    """This Python's site directories (and the one torch is in, should it come from PYTHONPATH), in path order."""
    dirs = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs.append(str(torch_dir))
    out: list[str] = []
    for d in dirs:
        if os.path.isdir(d) and os.path.realpath(d) not in map(os.path.realpath, out):
            out.append(d)
    return out


def link(venv: Path, torch_dir: Path) -> Path:
    """The venv sees this Python's packages after its own (what ``--system-site-packages`` does, for a base
    interpreter and for a venv alike): a ``.pth`` file that adds each site directory with ``site.addsitedir`` (which
    also runs the ``.pth`` files there)."""
    target = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    if not target.is_dir():
        raise InstallError(
            f"{venv} has no {target.relative_to(venv)}: not a venv of Python "
            f"{sys.version_info.major}.{sys.version_info.minor}",
            1,
        )
    lines = [f"import site; site.addsitedir({d!r})" for d in site_dirs(torch_dir)]
    (target / PTH).write_text("\n".join(lines) + "\n")
    return target / PTH


def verify(version: str, direct: list[str]) -> str:
    """Run in the venv: torch imports, from the environment (not the venv), at the version setup saw, and every
    package it requires is there in a version it accepts (the lock's copy where the venv has one, which shadows the
    environment's); so is every requirement of ``direct`` (what setup installed) and of what they need. Returns
    a one-line summary that names the environment's packages the lock shadows."""
    import importlib.metadata

    from packaging.requirements import Requirement

    try:
        with warnings.catch_warnings():  # torch's own import warnings (e.g. no numpy) are not this check's findings
            warnings.simplefilter("ignore")
            import torch
    except Exception as e:  # noqa: BLE001 - any import failure is the message
        raise InstallError(f"the environment's torch does not import in the venv: {type(e).__name__}: {e}", 1) from e
    if not getattr(torch, "__file__", None):
        raise InstallError(
            f"the environment's torch is not a package (a directory without __init__.py: {torch.__path__})", 1
        )
    where = Path(torch.__file__).resolve()
    if Path(sys.prefix).resolve() in where.parents:
        raise InstallError(f"the venv has its own torch ({where.parent}); the environment's should be the only one", 1)
    if torch.__version__ != version:
        raise InstallError(f"the venv imports torch {torch.__version__}, setup saw {version} in the environment", 1)
    problems = []
    for text in importlib.metadata.requires("torch") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req} (the venv sees {have})")
    if problems:
        raise InstallError(f"the environment's torch {version} needs {'; '.join(problems)}", 1)
    unmet = unmet_requirements(direct)
    if unmet:
        more = f" and {len(unmet) - 10} more" if len(unmet) > 10 else ""
        raise InstallError(f"requirements not met in the venv: {'; '.join(unmet[:10])}{more}", 1)
    seen: dict[str, list[str]] = {}
    paths: set[tuple[str, str]] = set()
    for dist in importlib.metadata.distributions():
        path = os.path.realpath(str(dist.locate_file("")))
        name = canonical(dist.metadata["Name"] or "")
        if (name, path) not in paths:
            paths.add((name, path))
            seen.setdefault(name, []).append(dist.version)
    shadowed = sorted(f"{n} {v[1]} -> {v[0]}" for n, v in seen.items() if len(v) > 1 and v[0] != v[1])
    line = f"torch {version} from the environment ({where.parent.parent})"
    if shadowed:
        more = f" and {len(shadowed) - 12} more" if len(shadowed) > 12 else ""
        line += f"; the lock's versions shadow {len(shadowed)} of its packages: {', '.join(shadowed[:12])}{more}"
    return line


def unmet_requirements(direct: list[str]) -> list[str]:
    """Each requirement, of ``direct`` and (transitively, extras included) of every package they need, that the
    packages this Python sees first do not meet: ``NAME SPEC (the venv sees VERSION | not installed)``."""
    import importlib.metadata

    from packaging.requirements import Requirement

    unmet: list[str] = []
    queue = [(Requirement(r), "setup") for r in direct]
    seen: set[tuple[str, frozenset[str]]] = set()
    while queue:
        req, parent = queue.pop(0)
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{parent} needs {str(req).split(';')[0].strip()} (not installed)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{parent} needs {str(req).split(';')[0].strip()} (the venv sees {have})")
        key = (canonical(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        for text in importlib.metadata.requires(req.name) or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                queue.append((sub, f"{canonical(req.name)} {have}"))
    return unmet


def installed_roots(requirements: Path, installed: Path) -> list[str]:
    """What setup installed (the pins of ``installed``, the file it gave the installer) as requirements, each with
    the extras requirements.txt asks of it (``ray[default,train]``), and torch."""
    from cluster.lockfile import parse_lock

    _, pins = parse_lock(installed.read_text())
    extras = {}
    for line in requirements.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?", line)
        if m and m.group(2):
            extras[canonical(m.group(1))] = m.group(2)
    return ["torch", *(f"{n}{extras.get(n, '')}=={p.version}" for n, p in pins.items())]


# -- the command line (launch.sh) --------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (launch.sh's bad-input convention)
        self.exit(2, f"[{self.prog}] error: {message}\n")


def main(argv: list[str] | None = None) -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 - pyproject.toml: requires-python; the environment may be older
        print(
            f"[setup] error: {sys.executable} is Python {sys.version.split()[0]}; the project needs 3.11 or later",
            file=sys.stderr,
        )
        return 2
    argv = sys.argv[1:] if argv is None else argv
    tag = "wheelhouse" if argv[:1] == ["wheelhouse"] else "setup"  # the launch.sh command it serves, in messages
    parser = _Parser(prog=tag, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("probe", help="this Python's torch: VERSION CUDA SITE_DIR, or refused")
    p.add_argument("venv", type=Path)
    p.add_argument("--auto", action="store_true", help="answer only for a CUDA torch (else nothing, exit 1)")
    p.add_argument("--offline", action="store_true", help="for setup --offline (its messages)")
    p = sub.add_parser("link", help="the venv sees this Python's packages after its own")
    p.add_argument("venv", type=Path)
    p.add_argument("torch_dir", type=Path)
    p = sub.add_parser("requirements", help="the lock less torch and what only torch needs (from a wheelhouse)")
    p.add_argument("lock", type=Path)
    p.add_argument("--wheelhouse", type=Path)
    p = sub.add_parser("verify", help="(in the venv) torch imports from the environment, all requirements hold")
    p.add_argument("version")
    p.add_argument("--installed", type=Path, required=True, help="the requirements file setup installed")
    p = sub.add_parser("wheelhouse", help="./launch.sh wheelhouse", prog="wheelhouse")
    p.add_argument("dir")
    p.add_argument("--lock", required=True)
    p.add_argument("--uv", required=True)
    p.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    p.add_argument("--platform", default=f"manylinux_2_28_{os.uname().machine}")
    p.add_argument("--without", default="", help="comma-separated: " + ", ".join(OPTIONAL))
    p.add_argument("--environment", help="pip list --format=freeze|json of the target environment")
    p = sub.add_parser(
        "uv-sources", help="pip's package sources as uv's environment variables, NAME=VALUE a line (SSL_CERT_FILE too)"
    )
    p.add_argument("kind", choices=["all", "lock", "cuda", "cuda-lock"])
    args = parser.parse_args(argv)
    tag = f"[{tag}]"
    try:
        if args.command == "probe":
            found = probe(args.venv, ROOT / "pyproject.toml", args.auto, args.offline)
            if not found:
                return 1
            print(found)
        elif args.command == "link":
            link(args.venv, args.torch_dir)
        elif args.command == "requirements":
            text, note = install_requirements(args.lock, args.wheelhouse)
            sys.stdout.write(text)
            print(f"{tag} {note}", file=sys.stderr)
        elif args.command == "verify":
            direct = installed_roots(ROOT / "requirements.txt", args.installed)
            print(f"{tag} {verify(args.version, direct)}", file=sys.stderr)
        elif args.command == "wheelhouse":
            wheelhouse(args)
        else:
            for name, value in uv_sources(args.kind).items():
                print(f"{name}={value}")
    except InstallError as e:
        print(f"{tag} error: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
