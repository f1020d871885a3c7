"""The module-level import graph of `jbackends` and `pallas_kernels` has no cycle.

Only imports that run when a module is imported count: top-level `import` / `from ... import`
statements, also inside a top-level `if` / `try` / `with` (not under `if TYPE_CHECKING:`), never imports
inside functions or classes. An edge goes to the module named (`from pkg import mod` to `pkg.mod` when
that is a module), not to the parent packages that importing it also runs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jbackends", "pallas_kernels")

# Known edges of cycles, (importer, imported), each with its reason. Empty: there are none.
ALLOWED_EDGES: set[tuple[str, str]] = set()


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level_imports(block)
        elif isinstance(node, ast.With):
            yield from _top_level_imports(node.body)


def _source(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module a `from ... import` in module `name` reads from (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _top_level_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _source(node, name, is_package)
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for component in components:  # a shortest path back to the start, inside the component
        members = set(component)
        start = component[0]
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        cycle = paths[v] + [start]
                        break
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return cycles


def test_cycles_are_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_the_packages():
    graph = _graph()
    assert "jbackends._src.flag_state" in graph and "pallas_kernels.attention" in graph
    assert "jbackends._src.flag_declarations" in graph["jbackends._src.flag_state"]


def test_allowed_edges_exist():
    graph = _graph()
    stale = sorted(edge for edge in ALLOWED_EDGES if edge[1] not in graph.get(edge[0], ()))
    assert not stale, f"allow-listed import edges no longer exist (remove them from ALLOWED_EDGES): {stale}"


def test_no_import_cycle():
    graph = {v: {w for w in ws if (v, w) not in ALLOWED_EDGES} for v, ws in _graph().items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycle(s):\n" + "\n".join(" -> ".join(c) for c in cycles)


def _private_uses(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[str]:
    """`from <our module> import _x` and `<our module alias>._x` in one module (anywhere in it)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    aliases: dict[str, str] = {}  # local name -> our module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            source = _source(node, name, is_package)
            if source not in modules or source == name:
                continue
            for a in node.names:
                full = f"{source}.{a.name}"
                if full in modules:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{name}: from {source} import {a.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and aliases[node.value.id] != name
        ):
            found.append(f"{name}: {node.value.id}.{node.attr} ({aliases[node.value.id]})")
    return found


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    found = sorted({f for name, path in modules.items() for f in _private_uses(name, path, modules)})
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_kernels_never_import_jbackends():
    """`pallas_kernels` is flag-free: no module there imports `jbackends` (at any level, functions too)."""
    found = []
    for name, path in _modules().items():
        if not name.startswith("pallas_kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [
                    f"{name}: import {a.name}" for a in node.names if a.name.split(".")[0] == "jbackends"
                ]
            elif (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and (node.module or "").split(".")[0] == "jbackends"
            ):
                found.append(f"{name}: from {node.module} import ...")
    assert not found, "\n".join(found)
