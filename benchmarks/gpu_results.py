"""What a run of the one GPU check (:mod:`benchmarks.gpu_check`) prints and writes: its table, and its results
file ``<date>-<gpu>.md``, never written over an earlier one."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table(result: dict) -> str:
    lines = [f"device {result['device']} (torch {result['torch']}{', tiny size' if result['tiny'] else ''})"]
    lines += [f"{name:<12} {v['status']:<5} {v['figure']}" for name, v in result["items"].items()]
    lines.append(f"{'passed' if result['passed'] else 'FAILED'}")
    return "\n".join(lines)


def results_markdown(result: dict, command: str) -> str:
    """The results file of a run of the check (``benchmarks/results/<date>-<gpu>.md``): the command, the machine and
    one row per item."""
    day = time.strftime("%Y-%m-%d", time.gmtime())
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = git.stdout.strip() if git.returncode == 0 else "unknown (no git metadata)"
    rows = "\n".join(
        f"| `{name}` | {v['status']} | {v['figure'].replace('|', '/')} | {v.get('seconds', '')} |"
        for name, v in result["items"].items()
    )
    return (
        f"# {day}: the one GPU check on {result['device']}\n\n"
        f"Command: `{command}` (torch {result['torch']}{', tiny size' if result['tiny'] else ''}; commit {commit}). "
        f"Items and their goals: `benchmarks/gpu_check.py`. Overall: {'passed' if result['passed'] else 'FAILED'}.\n\n"
        "| item | status | figure | seconds |\n|---|---|---|---|\n" + rows + "\n"
    )


def results_name(result: dict) -> str:
    """``<date>-<gpu>.md``: the device's name reduced to a slug (``NVIDIA H200`` -> ``h200``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", result["device"].lower().removeprefix("nvidia ")).strip("-") or "cpu"
    return f"{time.strftime('%Y-%m-%d', time.gmtime())}-{slug}.md"


def write_new(folder: Path, name: str, text: str) -> Path:
    """Write ``text`` to ``folder/name``, or ``<stem>-2.md``, ``-3``, ... when taken: never over an earlier run's file
    (or the notes added to it)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem, n = name.removesuffix(".md"), 1
    while True:
        out = folder / (name if n == 1 else f"{stem}-{n}.md")
        try:
            with open(out, "x", encoding="utf-8") as f:
                f.write(text)
            return out
        except FileExistsError:
            n += 1
