"""The gateway's modules import in one direction (issue 38): no import cycle, type-only imports
counted (the state, admission and budgets modules once formed one), and routes never import
routes: what two routes share lives in a service module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.gateway.support import REPO

PACKAGES = ("gateway", "tenancy", "billing", "caching")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path], *, lazy: bool) -> Iterator[str]:
    """The known modules `name` imports at module level, `if TYPE_CHECKING:` blocks included;
    with `lazy`, inside functions too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def nearest(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def walk(nodes: list[ast.stmt]) -> Iterator[str]:
        for node in nodes:
            if isinstance(node, ast.Import):
                yield from filter(None, (nearest(alias.name) for alias in node.names))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    target = nearest(f"{base}.{alias.name}")
                    if target is not None:
                        yield target
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if lazy:
                    yield from walk(node.body)
            else:  # class bodies, if (TYPE_CHECKING too), try, with, loops
                for handler in getattr(node, "handlers", []):
                    yield from walk(handler.body)
                for field in ("body", "orelse", "finalbody"):
                    children = getattr(node, field, None)
                    if isinstance(children, list):
                        yield from walk(children)

    return (target for target in walk(ast.parse(path.read_text()).body) if target != name)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_type_only_imports_counted():
    known = modules()
    graph = {name: set(imports(name, path, known, lazy=False)) for name, path in known.items()}
    assert "gateway.state" in graph["gateway.admission"]  # a type-only import is counted
    assert cycles(graph) == []


def test_routes_never_import_routes():
    known = modules()
    offenders = []
    for name, path in known.items():
        if not name.startswith(("gateway.routes.", "gateway.console.")):
            continue
        for target in imports(name, path, known, lazy=True):
            # a package of routers gathers its own children; nothing else reaches a route
            own_child = path.name == "__init__.py" and target.startswith(name + ".")
            if target.startswith("gateway.routes") and not own_child:
                offenders.append(f"{name} -> {target}")
    assert offenders == []
