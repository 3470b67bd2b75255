"""The daemon and the engine-side ipc package never import the simulated
engines (``kvsidecar.sim``): what runs in production must not depend on test
and demo code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative: resolve against the file's package
                pkg = ["kvsidecar", *path.parent.relative_to(ROOT).parts]
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join([*base, mod] if mod else base)
            names.append(mod)
    return names


@pytest.mark.parametrize("package", ["daemon", "ipc"])
def test_production_packages_import_nothing_from_sim(package: str) -> None:
    offenders = {
        f"{p.relative_to(ROOT)}: {name}"
        for p in sorted((ROOT / package).rglob("*.py"))
        for name in _imports(p)
        if name == "kvsidecar.sim" or name.startswith("kvsidecar.sim.")
    }
    assert not offenders
