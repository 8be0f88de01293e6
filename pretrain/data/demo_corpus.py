"""The built-in demo corpus: real English prose that ships with Python itself, no download.

``build_demo_corpus(cache_dir)`` writes ``cache_dir/demo_corpus_v1.txt``: one document (a paragraph)
per line, UTF-8, deterministic for a given Python installation. It contains, in this order:

1. the Python reference-manual topics of ``pydoc_data.topics`` (the text ``help("topic")`` shows:
   the language reference on statements, expressions, the data model...), sorted by topic name;
2. the docstrings of the standard library: every triple-quoted string literal that opens a line
   (module, class and function docstrings, plus a few similar literals) in the ``*.py`` files under
   ``sysconfig.get_paths()["stdlib"]``, walked in sorted order (test packages and ``site-packages``
   excluded). Files are scanned as text -- nothing is imported or even compiled -- so there are no
   side effects and the result does not depend on what the process imported before.

Each text is split into paragraphs on blank lines; wrapped lines are joined with single spaces.
A paragraph is kept when it has at least 10 words, at least 85% letters and spaces, at least 70%
plain words, and no doctest (``>>>``); duplicates are dropped (first occurrence kept).

On CPython 3.11.7 (734 stdlib files) it has 1,495,816 bytes, 8,715 documents (1,135 of them,
260 kB, from the reference topics; mean 171 characters, longest 2,658); about 333k tokens with the
default 8192-token BPE. Later calls reuse the file after checking it against
the SHA-256 recorded next to it (``.sha256``). The file is written atomically (temporary file +
rename) and nothing is printed.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import sysconfig
import tempfile
from pathlib import Path

CORPUS_NAME = "demo_corpus_v1.txt"
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}
_WORD = re.compile(r"[A-Za-z]+(?:['’-][A-Za-z]+)*")
_PUNCT = ".,;:!?\"'()*`[]"
# comments, one-line strings and (prefixed) triple-quoted strings, scanned in order so that the end of
# one string is never taken for the start of another
_LITERALS = re.compile(
    r'''#[^\n]*|([rRbBuUfF]{0,2})("""|\'\'\')(.*?)\2|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*\'''', re.S
)


def _paragraphs(text: str):
    current: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped:
            current.append(stripped)
        elif current:
            yield " ".join(current)
            current = []
    if current:
        yield " ".join(current)


def _is_prose(paragraph: str) -> bool:
    words = paragraph.split()
    if len(words) < 10 or ">>>" in paragraph:
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    if letters < 0.85 * len(paragraph):
        return False
    plain = sum(1 for w in words if _WORD.fullmatch(w.strip(_PUNCT)))
    return plain >= 0.7 * len(words)


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS and not d.startswith("."))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def _docstrings(source: str):
    """Triple-quoted string literals that open a line (docstrings), found by one left-to-right scan."""
    for m in _LITERALS.finditer(source):
        if m.group(2) is None or m.group(1).lower() not in ("", "r", "u"):
            continue  # a comment, a one-line string, a bytes or f-string
        line_start = source.rfind("\n", 0, m.start()) + 1
        if not source[line_start : m.start()].strip():
            yield inspect.cleandoc(m.group(3))


def _texts():
    import pydoc_data.topics as topics

    for key in sorted(topics.topics):
        yield topics.topics[key]
    for path in _stdlib_files():
        yield from _docstrings(path.read_text(encoding="utf-8", errors="replace"))


def demo_corpus_text() -> str:
    """The corpus as one string (one paragraph per line, trailing newline)."""
    seen: set[str] = set()
    docs: list[str] = []
    for text in _texts():
        for para in _paragraphs(text):
            if para not in seen and _is_prose(para):
                seen.add(para)
                docs.append(para)
    return "\n".join(docs) + "\n"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_demo_corpus(cache_dir: Path | str) -> Path:
    """Materialize the demo corpus under ``cache_dir`` (once) and return the path of the text file."""
    cache_dir = Path(cache_dir).expanduser().resolve()
    path = cache_dir / CORPUS_NAME
    sha_path = path.with_name(path.name + ".sha256")
    if path.is_file() and sha_path.is_file():
        if sha_path.read_text().strip() == _sha256(path):
            return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    data = demo_corpus_text().encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()
    for target, payload in ((path, data), (sha_path, (digest + "\n").encode())):
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path
