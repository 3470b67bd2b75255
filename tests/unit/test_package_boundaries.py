"""The package's shape: which package may import which, no import circle, no
oversized module.

- Layers (lower never imports higher): ``ipc`` (what engines import) and
  ``metrics`` import only themselves and the root; ``daemon`` adds ``ipc`` and
  ``metrics``; ``integrations`` (engine adapters) adds ``ipc`` only; ``sim``
  (simulated engines, demo, chaos) and ``cli`` may use everything but the
  daemon never imports ``sim``.
- No circle among modules, counting imports inside functions too (a deferred
  import that dodges a circle is still a circle).
- No module of the package over 800 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("daemon", "ipc", "metrics", "sim", "integrations")
MAX_LINES = 800
#: package -> the packages (besides itself and the root module) it may import
MAY_IMPORT: dict[str, set[str]] = {
    "ipc": set(),
    "metrics": set(),
    "daemon": {"ipc", "metrics"},
    "integrations": {"ipc"},
    "sim": {"daemon", "ipc", "metrics"},
}


def _sources() -> list[Path]:
    files = [ROOT / "__init__.py", ROOT / "cli.py", ROOT / "__main__.py"]
    for pkg in PACKAGES:
        if (ROOT / pkg).is_dir():
            files += sorted((ROOT / pkg).rglob("*.py"))
    return files


def _module(path: Path) -> str:
    parts = ["kvsidecar", *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module(p): p for p in _sources()}


def _imports(path: Path) -> list[str]:
    """Every kvsidecar module ``path`` imports (``from a import b`` names a.b
    when b is a module), at any depth of the file."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: resolve against the file's package
                pkg = _module(path).split(".")
                if path.name != "__init__.py":
                    pkg = pkg[:-1]
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join([*base, mod] if mod else base)
            for a in node.names:
                sub = f"{mod}.{a.name}"
                names.append(sub if sub in MODULES else mod)
    return [n for n in names if n == "kvsidecar" or n.startswith("kvsidecar.")]


GRAPH = {m: {i for i in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_no_package_imports_upward(package: str) -> None:
    allowed = MAY_IMPORT[package] | {package, ""}
    offenders = sorted(f"{m} -> {i}" for m, deps in GRAPH.items() if _package(m) == package
                       for i in deps if _package(i) not in allowed)
    assert not offenders


def test_no_import_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
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
                circles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles


@pytest.mark.parametrize("module", sorted(MODULES), ids=sorted(MODULES))
def test_module_is_at_most_800_lines(module: str) -> None:
    n = len(MODULES[module].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)}: {n} lines"


def test_the_graph_sees_the_package() -> None:
    """The checks above are only as good as the graph: it must know the hubs."""
    assert "kvsidecar.ipc.protocol" in MODULES
    assert "kvsidecar.ipc.protocol" in GRAPH["kvsidecar.ipc.client"]
    assert "kvsidecar.ipc.layout" in GRAPH["kvsidecar.daemon.planner"] | {
        i for m, deps in GRAPH.items() if m.startswith("kvsidecar.daemon.planner.") for i in deps}
