"""The static import graph of batchd's sources, read with ``ast`` (nothing is imported).

Every ``import`` statement counts, wherever it is: at the top, under ``if TYPE_CHECKING:``
(a cycle or a layering breach there breaks the type checker and every refactor that moves the
import up), inside functions. ``tests/repo/test_codebase.py`` looks for cycles in it and
``tests/repo/test_layout.py`` checks who may import what.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "REPO",
    "SOURCE_ROOTS",
    "Import",
    "Statement",
    "cycles_in",
    "describe",
    "import_graph",
    "imports_of",
    "module_names",
    "statements_of",
    "strongly_connected",
    "under",
    "with_parents",
]

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = (REPO / "server" / "src", REPO / "client" / "src")


@dataclass(frozen=True)
class Import:
    """One edge of the graph: ``source`` imports ``target`` at ``where`` (path:line)."""

    source: str
    target: str
    where: str


@dataclass(frozen=True)
class Statement:
    """One import statement of ``module``, as written at ``where`` (path:line).

    ``modules`` are the modules it surely runs (``import a.b`` -> ``a.b``; ``from a.b import
    c`` -> ``a.b``); ``names`` are the dotted names it binds (``a.b``; ``a.b.c``, which may be
    a module or an attribute). Relative imports are resolved.
    """

    module: str
    where: str
    text: str
    modules: tuple[str, ...]
    names: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def under(name: str, *prefixes: str) -> bool:
    """Whether dotted ``name`` is one of ``prefixes`` or inside one (``a.b`` is under ``a``)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_names(root: Path) -> dict[str, Path]:
    """Every module under the source ``root``, by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def with_parents(name: str) -> list[str]:
    """``a.b.c`` and the packages an import of it runs first: ``a``, ``a.b``, ``a.b.c``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def statements_of(name: str, path: Path) -> Iterator[Statement]:
    """Every import statement of module ``name`` (file ``path``), in the order of the file."""
    package = _package_of(name, path)
    where = str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    nodes = [
        node
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        if isinstance(node, ast.Import):
            modules = tuple(alias.name for alias in node.names)
            names = modules
        else:
            if node.level:
                base = package.split(".") if package else []
                if node.level > len(base):
                    raise AssertionError(f"{where}:{node.lineno}: relative import beyond the top")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            modules = (module,)
            names = tuple(f"{module}.{alias.name}" for alias in node.names)
        yield Statement(name, f"{where}:{node.lineno}", ast.unparse(node), modules, names)


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[Import]:
    """The modules of ``known`` that importing module ``name`` (file ``path``) may import.

    ``import a.b.c`` imports ``a``, ``a.b`` and ``a.b.c``; ``from a.b import c`` imports ``a``
    and ``a.b``, and ``a.b.c`` when that is a module. An import of one of the module's own
    enclosing packages is left out: Python always starts running those before the module
    itself, so such an import never starts them (``from batchd.errors import X`` inside
    ``batchd._loader`` does not run ``batchd/__init__.py`` again).
    """
    package = _package_of(name, path)
    enclosing = set(with_parents(package)) if package else set()
    for statement in statements_of(name, path):
        targets = [t for module in statement.modules for t in with_parents(module)]
        for target in [*targets, *statement.names]:
            if target in known and target != name and target not in enclosing:
                yield Import(name, target, statement.where)


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
