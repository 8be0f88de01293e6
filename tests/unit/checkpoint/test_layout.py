"""No checkpoint layout name is spelled outside the checkpoint layer: the file names of a checkpoint and a run
directory (``manifest.json``, ``config.yaml``, ``trainer_state.json``, ...) and its directory entries used as
path parts (``run_dir / "tokenizer"``, ``ckpt / "data"``) live in ``pretrain/checkpoint/layout.py`` only. The scan
reads the AST of every source file outside ``pretrain/checkpoint/`` and ``tests/`` (docstrings are prose, not
code, and are skipped)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from pretrain.checkpoint import layout

ROOT = Path(__file__).resolve().parents[3]

FILE_NAMES = {
    layout.MANIFEST,
    layout.CONFIG,
    layout.TRAINER_STATE,
    layout.WEIGHTS,
    layout.OPTIMIZER,
    layout.INIT_WEIGHTS,
    layout.SUMMARY,
}
"""Names that mean a checkpoint file wherever they appear as a path segment of a string."""
DIR_NAMES = {layout.TOKENIZER, layout.DATA_DIR, layout.RNG_DIR, layout.DS_DIR, layout.DS_TAG, layout.ABANDONED}
"""Common words: layout names only when used as a path part (``x / "data"``, ``Path(x, "data")``, ``joinpath``)."""
PATTERNS = [re.compile(r"(^|/)rank_\{\}\.(json|pt)$"), re.compile(r"\.(tmp|old)-step_")]
"""Per-rank files and staging names, in f-strings (each placeholder reads as ``{}``)."""

ALLOWED = {("pretrain/train/tracking.py", "config/config.yaml"), ("pretrain/data/shards/format.py", "manifest.json")}
"""Names that happen to share a layout file name but are not paths in a checkpoint: an MLflow artifact, and the
manifest of a token-shard directory (its own layout, ``pretrain/data/shards/format.py``)."""


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and _text(n.value) is not None}


def _path_operands(tree: ast.AST) -> list[ast.AST]:
    out: list[ast.AST] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div):
            out += [n.left, n.right]
        elif isinstance(n, ast.Call):
            f = n.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("Path", "joinpath", "join", "PurePath", "PosixPath"):
                out += n.args
    return out


def layout_literals(source: str, filename: str = "<src>") -> list[str]:
    """``line: literal`` for every layout name spelled in ``source``."""
    tree = ast.parse(source, filename)
    # Docstrings are prose; an f-string's constant parts are scanned as part of their f-string.
    skip = _docstrings(tree) | {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for n in ast.walk(tree):
        text = _text(n) if id(n) not in skip else None
        if text is None:
            continue
        if set(text.split("/")) & FILE_NAMES or any(p.search(text) for p in PATTERNS):
            found.append(f"{n.lineno}: {text!r}")
    for n in _path_operands(tree):
        text = _text(n)
        if text is not None and set(text.strip("/").split("/")) & DIR_NAMES:
            found.append(f"{n.lineno}: {text!r} as a path part")
    return found


def _sources() -> list[Path]:
    files = [p for d in ("pretrain", "cluster", "eval") for p in (ROOT / d).rglob("*.py")]
    return sorted(p for p in files if not p.is_relative_to(ROOT / "pretrain" / "checkpoint"))


def test_no_layout_name_outside_the_checkpoint_layer():
    offenders = []
    files = _sources()
    assert len(files) > 40 and not any(p.is_relative_to(ROOT / "pretrain" / "checkpoint") for p in files)
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for hit in layout_literals(path.read_text(), rel):
            if (rel, hit.split(": ", 1)[1].split(" as ")[0].strip("'\"")) not in ALLOWED:
                offenders.append(f"{rel}:{hit}")
    assert not offenders, (
        "layout names spelled outside pretrain/checkpoint/ (use pretrain.checkpoint.layout):\n" + "\n".join(offenders)
    )


def test_the_scan_finds_what_the_old_code_spelled():
    """The scan is not vacuous: lines of the code before the checkpoint layer are all found; prose, unrelated
    words and the layout constants are not."""
    old = '''
def f(stage, ckpt, run_dir, rank, step, nonce):
    """Writes manifest.json and config.yaml (a docstring: prose)."""
    (stage / "config.yaml").write_text("")
    write_json(stage / "trainer_state.json", {})
    shutil.copytree(src, stage / "tokenizer")
    files = (ckpt / "data").glob("rank_*.json")
    write_json(stage / "data" / f"rank_{rank}.json", {})
    torch.save({}, stage / "rng" / f"rank_{rank}.pt")
    path = run_dir / "init_weights.pt"
    x = {"states": "rng/rank_R.pt", "file": "manifest.json"}
    tmp = run_dir / f".tmp-step_{step:08d}-{nonce}"
    tok = Path(ckpt, "tokenizer")
    y = ckpt.joinpath("ds")
    '''
    hits = layout_literals(old)
    lines = sorted({int(h.split(":")[0]) for h in hits})
    assert lines == list(range(4, 15)), hits
    clean = '''
def g(d, cfg):
    """Reads config.yaml from d."""
    data = {"data": cfg["data"], "tokenizer": "x"}
    name = "state"
    (d / layout.CONFIG).write_text("")
    return d / layout.data_file(0), "configs/demo.yaml", f"plan/step_{1:08d}.json"
    '''
    assert layout_literals(clean) == []
