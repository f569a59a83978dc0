"""The import graph, read from the source with ``ast``: arrows only point down.

Every ``import`` counts, also inside functions and under ``TYPE_CHECKING``: a module that
needs another only for a type still depends on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("wheelhouse", "web", "worker")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def imports_of(name: str) -> set[str]:
    """Every module (ours or not) that ``name`` imports, as a dotted name.

    ``from pkg import mod`` is an import of ``pkg.mod`` when that is a module; the parent
    packages a submodule import runs first are not counted as arrows.
    """
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in imports_of(name) if m in MODULES} for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read_from_the_source() -> None:
    """The reader itself: arrows a cycle check must see are seen."""
    assert "web.services" in imports_of("web.app")  # from web.services import Services
    assert "web.simple" in imports_of("web.app")  # from web import simple
    assert "web.metrics" in imports_of("web.services")
    assert "flask" in imports_of("web.services")
    assert "worker.supervision.runner" in imports_of("worker.build")  # from ...runner import Runner


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = {k: {m for m in v if m.split(".")[0] == package}
             for k, v in _graph().items() if k.split(".")[0] == package}
    assert _cycles(graph) == []


def test_no_import_cycles_across_the_tree() -> None:
    assert _cycles(_graph()) == []


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("wheelhouse", ("web", "worker", "flask", "werkzeug", "jinja2", "gunicorn")),
        ("web", ("worker",)),
        ("worker", ("web", "flask")),
        # The runner gets the narrow scope it reads (runner.BuildScope), not the steps' context.
        ("worker.supervision", ("worker.steps",)),
    ],
)
def test_layers(package: str, forbidden: tuple[str, ...]) -> None:
    wrong = sorted(f"{name} imports {imp}" for name in MODULES if _under(name, package)
                   for imp in imports_of(name) if any(_under(imp, f) for f in forbidden))
    assert wrong == []


def test_blueprints_reach_services_through_web_services() -> None:
    """Only the app factory imports ``web.app``; everything else reads ``web.services``."""
    users = sorted(name for name in MODULES if "web.app" in imports_of(name))
    assert users == ["web"]
