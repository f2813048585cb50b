"""The source tree keeps its own rules: no import cycle among batchd's modules, no
hand-written file over 600 lines (a file that long holds more than one job), no two test
files of one name. Which package may import what is ``test_layout.py``'s."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from import_graph import (
    REPO,
    SOURCE_ROOTS,
    cycles_in,
    describe,
    import_graph,
    strongly_connected,
)

MAX_LINES = 600
GENERATED = ("_pb2.py", "_pb2_grpc.py", ".pyi")
"""Endings of files that tools write (protoc); ``migrations/versions`` are written by
alembic and never edited by hand afterwards."""


# -- the import graph (tests/import_graph.py) ------------------------------------------------


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
    """Every .py under server/src, client/src, tests, bench and examples that no tool
    generated."""
    for root in (*SOURCE_ROOTS, REPO / "tests", REPO / "bench", REPO / "examples"):
        for path in sorted(root.rglob("*.py")):
            if path.name.endswith(GENERATED) or "migrations/versions" in path.as_posix():
                continue
            yield path


def test_no_hand_written_python_file_is_over_600_lines() -> None:
    """A file holds one job; none of server/src, client/src, tests, bench or examples is
    longer than 600 lines (generated stubs and alembic revisions aside): one that would be
    holds more than one job, and splits along them."""
    sizes = {path: len(path.read_text().splitlines()) for path in hand_written_sources()}
    assert len(sizes) > 50 and REPO / "client/src/batchd/_transport/doorbell.py" in sizes
    assert not any(p.name.endswith("_pb2.py") for p in sizes)
    over = sorted((n, os.path.relpath(p, REPO)) for p, n in sizes.items() if n > MAX_LINES)
    assert not over, f"split these along their concepts (limit {MAX_LINES}): " + ", ".join(
        f"{name} ({n} lines)" for n, name in reversed(over)
    )


def test_no_two_test_files_share_a_name() -> None:
    """Test directories are not packages, so pytest imports each test file by its name alone
    (``rootdir``-relative ``prepend`` mode): two files of one name in different directories
    cannot both be collected, and the suite fails to start where both are chosen."""
    names: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        names.setdefault(path.name, []).append(os.path.relpath(path, REPO))
    assert len(names) > 100
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, f"rename one of each (say what it tests): {shared}"
