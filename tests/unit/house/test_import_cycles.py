"""No import circle between modules of ``pretrain/``, ``cluster/`` and ``eval/``, inside a package or across.

import-linter's layer contract orders packages; this test orders *modules*: it builds the import graph from the
source (every ``import`` statement, module-level and inside functions, ``TYPE_CHECKING`` blocks included) and
fails on any cycle. A name imported from a package ``__init__`` counts as an import of the submodule that
defines it (``from pretrain.config import RunConfig`` -> ``pretrain.config.tree``), so re-exports are no back door.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("pretrain", "cluster", "eval", "benchmarks")


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file (a package's ``__init__.py`` under the package's name)."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) of every import statement in ``path``, relative ones resolved."""
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, [a.name for a in node.names], node.lineno))
    return [(m, names, line) for m, names, line in found if m.split(".")[0] in PACKAGES]


def _defining_module(pkg: str, name: str, modules: dict[str, Path], reexports: dict[str, dict[str, str]]) -> str:
    """The module a name imported from ``pkg`` comes from: a submodule, a re-export's source, or ``pkg`` itself."""
    if f"{pkg}.{name}" in modules:
        return f"{pkg}.{name}"
    seen = set()
    while pkg in reexports and name in reexports[pkg] and pkg not in seen:
        seen.add(pkg)
        pkg = reexports[pkg][name]
    return pkg


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, over the project's own modules."""
    modules = _modules(root)
    raw = {name: _imports(name, path, modules) for name, path in modules.items()}
    reexports: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            reexports[name] = {n: m for m, names, _ in raw[name] for n in names if m in modules}
    graph: dict[str, dict[str, int]] = {}
    for name, imports in raw.items():
        edges = graph.setdefault(name, {})
        for mod, names, line in imports:
            targets = {_defining_module(mod, n, modules, reexports) for n in names} if names else {mod}
            for target in targets:
                while target not in modules and "." in target:  # `import a.b.c` of a non-module attribute
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    edges.setdefault(target, line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "pretrain.config.tree" in graph["pretrain.config.loading"]
    cycles = find_cycles(graph)
    lines = [
        " <-> ".join(c) + "   edges: " + ", ".join(f"{a}:{graph[a][b]} -> {b}" for a in c for b in graph[a] if b in c)
        for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(lines)


def test_the_cycle_finder_sees_function_level_and_reexported_imports(tmp_path):
    """The checker itself: a function-level import through a package ``__init__`` closes a cycle."""
    pkg = tmp_path / "pretrain" / "config"
    pkg.mkdir(parents=True)
    (tmp_path / "pretrain" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from pretrain.config.plan import make_plan\nfrom .tree import RunConfig\n")
    (pkg / "tree.py").write_text(
        "class RunConfig:\n    def validate(self):\n        from pretrain.config import make_plan\n"
    )
    (pkg / "plan.py").write_text("from pretrain.config.tree import RunConfig\n")
    for other in ("cluster", "eval"):
        (tmp_path / other).mkdir()
    cycles = find_cycles(import_graph(tmp_path))
    assert cycles == [["pretrain.config.plan", "pretrain.config.tree"]]
    (pkg / "tree.py").write_text("class RunConfig:\n    pass\n")
    assert find_cycles(import_graph(tmp_path)) == []
