"""The source tree keeps its own rules: no import cycle among batchd's modules, and no
hand-written file over 600 lines (the project's style: split a file that passes 600)."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (REPO / "server" / "src", REPO / "client" / "src")
MAX_LINES = 600
GENERATED = ("_pb2.py", "_pb2_grpc.py", ".pyi")
"""Endings of files that tools write (protoc); ``migrations/versions`` are written by
alembic and never edited by hand afterwards."""


# -- the import graph -------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One edge of the graph: ``source`` imports ``target`` at ``where`` (path:line)."""

    source: str
    target: str
    where: str


def module_names(root: Path) -> dict[str, Path]:
    """Every module under the source ``root``, by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _with_parents(name: str) -> list[str]:
    """``a.b.c`` and the packages an import of it runs first: ``a``, ``a.b``, ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[Import]:
    """The modules of ``known`` that importing module ``name`` (file ``path``) may import.

    Every ``import`` statement counts, wherever it is: at the top, under
    ``if TYPE_CHECKING:`` (a cycle there breaks the type checker and every refactor that
    moves the import up), inside functions. ``import a.b.c`` imports ``a``, ``a.b`` and
    ``a.b.c``; ``from a.b import c`` imports ``a`` and ``a.b``, and ``a.b.c`` when that is
    a module. An import of one of the module's own enclosing packages is left out: Python
    always starts running those before the module itself, so such an import never starts
    them (``from batchd.errors import X`` inside ``batchd._loader`` does not run
    ``batchd/__init__.py`` again).
    """
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    enclosing = set(_with_parents(package)) if package else set()
    where = os.path.relpath(path, REPO)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [t for alias in node.names for t in _with_parents(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                if node.level > len(base):
                    raise AssertionError(f"{where}:{node.lineno}: relative import beyond the top")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            targets = [*_with_parents(module), *(f"{module}.{a.name}" for a in node.names)]
        else:
            continue
        for target in targets:
            if target in known and target != name and target not in enclosing:
                yield Import(name, target, f"{where}:{node.lineno}")


def import_graph(roots: Iterable[Path]) -> dict[str, dict[str, Import]]:
    """module -> {imported module -> the first import statement that imports it}."""
    paths = {name: path for root in roots for name, path in module_names(root).items()}
    known = set(paths)
    graph: dict[str, dict[str, Import]] = {name: {} for name in paths}
    for name, path in paths.items():
        for edge in imports_of(name, path, known):
            graph[name].setdefault(edge.target, edge)
    return graph


def strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): the components of more than one module, or of one
    module that imports itself, each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return sorted(found)


def shortest_cycle(graph: dict[str, dict[str, Import]], start: str) -> list[Import] | None:
    """A shortest cycle through ``start`` (breadth first), as its import edges; None if none."""
    came_from: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target, edge in sorted(graph[node].items()):
                if target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came_from[path[0].source])
                    return path
                if target not in came_from:
                    came_from[target] = edge
                    following.append(target)
        frontier = following
    return None


def cycles_in(graph: dict[str, dict[str, Import]], component: list[str]) -> list[list[Import]]:
    """The shortest cycle through each module of ``component``, each cycle once."""
    cycles: dict[tuple[str, ...], list[Import]] = {}
    for member in component:
        cycle = shortest_cycle(graph, member)
        assert cycle is not None, f"{member} is in no cycle of {component}"
        first = min(range(len(cycle)), key=lambda i: cycle[i].source)
        cycle = cycle[first:] + cycle[:first]
        cycles.setdefault(tuple(edge.source for edge in cycle), cycle)
    return [cycles[key] for key in sorted(cycles)]


def describe(cycle: list[Import]) -> str:
    """``a -> b -> a`` and, below it, where each import is written."""
    names = " -> ".join([*(edge.source for edge in cycle), cycle[0].source])
    lines = [f"    {edge.source} -> {edge.target}  ({edge.where})" for edge in cycle]
    return "\n".join([f"  {names}", *lines])


def test_no_module_of_server_or_client_takes_part_in_an_import_cycle() -> None:
    """The static import graph of server/src and client/src (TYPE_CHECKING and
    function-local imports included) has no cycle; a failure prints each one found."""
    graph = import_graph(SOURCE_ROOTS)
    assert {"batchd", "batchd._loader", "batchd_server", "batchd_server.api"} <= set(graph)
    report = []
    for component in strongly_connected(graph):
        report.append(f"- {len(component)} modules import each other: {', '.join(component)}")
        report += [describe(cycle) for cycle in cycles_in(graph, component)]
    assert not report, (
        "import cycles; move what both sides need into a module that neither imports back, "
        "and type against a Protocol instead of importing the other side's class:\n"
        + "\n".join(report)
    )


TOY_TREE = {
    "toy/__init__.py": "from toy.api import serve\n",
    "toy/api/__init__.py": "from .server import serve\n",
    "toy/api/server.py": "from toy.bell import LIMIT\nfrom . import status\n",
    "toy/api/status.py": "import toy.errors\n",
    "toy/api/sessions.py": "from toy.errors import Fail\n",
    "toy/errors.py": "class Fail(Exception): ...\n",
    "toy/bell.py": (
        "from typing import TYPE_CHECKING\nLIMIT = 1\n"
        "if TYPE_CHECKING:\n    from toy.api.sessions import Session\n"
        "def notice():\n    from .errors import Fail\n"
    ),
    "toy/lone.py": "import toy.lone\n",
}
"""A tree shaped like batchd_server's cycle: ``bell`` imports ``api.sessions`` for types,
which runs ``api/__init__``, which imports ``api.server``, which imports ``bell``."""


def test_the_import_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself: package __init__ files, relative, TYPE_CHECKING and
    function-local imports, and ``from package import submodule`` are edges; a module's own
    packages are not; the cycle through a package __init__ is found and printed."""
    for name, text in TOY_TREE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph([tmp_path])
    assert {name: sorted(edges) for name, edges in graph.items()} == {
        "toy": ["toy.api"],
        "toy.api": ["toy.api.server"],
        "toy.api.server": ["toy.api.status", "toy.bell"],
        "toy.api.status": ["toy.errors"],
        "toy.api.sessions": ["toy.errors"],
        "toy.errors": [],
        "toy.bell": ["toy.api", "toy.api.sessions", "toy.errors"],
        "toy.lone": [],
    }
    components = strongly_connected(graph)
    assert components == [["toy.api", "toy.api.server", "toy.bell"]]
    (cycle,) = cycles_in(graph, components[0])
    printed = describe(cycle)
    assert printed.splitlines()[0] == "  toy.api -> toy.api.server -> toy.bell -> toy.api"
    assert "toy/bell.py:4)" in printed  # the TYPE_CHECKING import, with its line


# -- file sizes -------------------------------------------------------------------------------


def hand_written_sources() -> Iterator[Path]:
    """Every .py under server/src, client/src and tests that no tool generated."""
    for root in (*SOURCE_ROOTS, REPO / "tests"):
        for path in sorted(root.rglob("*.py")):
            if path.name.endswith(GENERATED) or "migrations/versions" in path.as_posix():
                continue
            yield path


def test_no_hand_written_python_file_is_over_600_lines() -> None:
    """Files of 100-400 lines, split past 600: none of server/src, client/src or tests is
    longer (generated stubs and alembic revisions aside)."""
    sizes = {path: len(path.read_text().splitlines()) for path in hand_written_sources()}
    assert len(sizes) > 50 and REPO / "client/src/batchd/_doorbell.py" in sizes
    assert not any(p.name.endswith("_pb2.py") for p in sizes)
    over = sorted((n, os.path.relpath(p, REPO)) for p, n in sizes.items() if n > MAX_LINES)
    assert not over, f"split these along their concepts (limit {MAX_LINES}): " + ", ".join(
        f"{name} ({n} lines)" for n, name in reversed(over)
    )
