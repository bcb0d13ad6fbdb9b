"""Every package's modules import each other without a circle, and the layers hold.

Why: the layers should read top-down (the CLI builds the app, the app assembles
the routers, the routes use helpers below them; an engine's plugin module
declares, its engine assembles, its kernels compute), and a circle hides an
upward dependency. Python tolerates some circles until an import order changes, and
then a name is missing from a half-initialized module. The check reads the
source with `ast` rather than importing it, so it sees every import: those at
module level, those deferred into a function (a common way to hide a circle),
and `from switchyard import openapi`, which names a submodule. Imports under
`if TYPE_CHECKING:` are left out: they never run, so they cannot form a circle
at import time.

Across packages: the contract imports nothing of ours, the engine toolkit only
the contract, and a plugin never the gateway (its distribution does not even
depend on it).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {
    "switchyard": REPO / "gateway" / "switchyard",
    "switchyard_spec": REPO / "spec" / "switchyard_spec",
    "switchyard_engine": REPO / "engine" / "switchyard_engine",
    "switchyard_xeon": REPO / "plugins" / "xeon" / "switchyard_xeon",
    "switchyard_gaudi": REPO / "plugins" / "gaudi" / "switchyard_gaudi",
    "switchyard_quant": REPO / "plugins" / "quant" / "switchyard_quant",
}
"""Each package of the repository and its source folder."""
ALLOWED = {
    "switchyard_spec": set(),
    "switchyard_engine": {"switchyard_spec"},
    "switchyard_quant": {"switchyard_spec"},
    "switchyard_xeon": {"switchyard_spec", "switchyard_engine"},
    "switchyard_gaudi": {"switchyard_spec", "switchyard_engine", "switchyard_quant"},
    "switchyard": {"switchyard_spec", "switchyard_engine"},
}
"""Which of our other packages each package may import (deferred imports included)."""
PACKAGE = "switchyard"
ROOT = PACKAGES[PACKAGE]


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = list(node.orelse)
        pending.extend(children)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    files = {_module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: climb from the importing module's package
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # `from pkg import sub` imports the submodule `pkg.sub`; otherwise a name of `pkg`.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                           for a in node.names]
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports as `[a, b, ..., a]`, or None (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph[module]):
            if target in on_path:
                return [*path[path.index(target):], target]
            if target not in done and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        on_path.discard(module)
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_the_walk_sees_imports() -> None:
    graph = import_graph()
    assert "switchyard.openapi" in graph["switchyard.routes.tgi"]


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_package_has_no_import_cycle(package: str) -> None:
    cycle = find_cycle(import_graph(PACKAGES[package]))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def foreign_imports(root: Path) -> set[str]:
    """The top-level names of our packages that modules under ``root`` import at run time."""
    found: set[str] = set()
    for path in root.rglob("*.py"):
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if not node.level else [])
            found |= {n.split(".")[0] for n in names} & set(PACKAGES)
    return found - {root.name}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_package_imports_only_the_layers_below_it(package: str) -> None:
    extra = foreign_imports(PACKAGES[package]) - ALLOWED[package]
    assert not extra, f"{package} imports {sorted(extra)}"


@pytest.mark.parametrize("plugin", ["xeon", "gaudi", "quant"])
def test_plugins_do_not_depend_on_the_gateway(plugin: str) -> None:
    project = tomllib.loads((REPO / "plugins" / plugin / "pyproject.toml").read_text())
    names = {dep.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
             for dep in project["project"]["dependencies"]}
    assert "switchyard" not in names


def test_the_check_finds_a_deferred_cycle(tmp_path: Path) -> None:
    """The check itself: a circle closed by an import inside a function is found."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from switchyard import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    import switchyard.a\n")
    graph = import_graph(pkg)
    assert graph["switchyard.c"] == set()
    assert find_cycle(graph) == ["switchyard.a", "switchyard.b", "switchyard.a"]
