"""The layout's rules, checked on the source: who may import what, and who may touch /dev/shm.

1. The server enters the client distribution only through ``batchd._wire``, ``batchd._proto``
   and ``batchd.errors`` (Python runs the package ``batchd`` first, as their parent).
2. grpc reaches the server only through ``batchd_server.api``, which only the entry point
   (``batchd_server.cli`` and ``cli_serve``) imports: domain code and the decode workers
   never load it.
3. SQLAlchemy and alembic are imported only by ``batchd_server.catalog`` and its migrations.
4. Only ``batchd_server.shm`` creates or unlinks shared-memory segments.
5. No import cycle: ``test_codebase.py``.
6. ``batchd._wire`` imports nothing of the client but ``batchd.errors``, ``batchd._proto``
   and itself, and neither grpc nor torch.
7. Floors: the server's rooms (its top-level modules and packages) stand in one order from
   the ground up, :data:`FLOORS`, one room a floor; a room imports only itself and the rooms
   below it, never one above. Of any two rooms one is above the other, so two rooms never
   import each other and the rooms' graph has no cycle (within a room, ``test_codebase.py``
   finds any). A new room fails the rule until it is given its floor.

The import rules read every import statement (``tests/import_graph.py``): under
``if TYPE_CHECKING:`` and inside functions too. A broken rule fails naming each offending
statement, ``path:line: the import``. Each rule is also run over a small tree with a breach,
so a checker that can no longer fail does not go unnoticed.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest

from import_graph import REPO, SOURCE_ROOTS, module_names, statements_of, under

CLIENT_ENTRANCES = ("batchd._wire", "batchd._proto", "batchd.errors")
"""What the server (rule 1) and the wire contract (rule 6) may import of the client."""
SQL = ("sqlalchemy", "alembic")
SQL_HOMES = ("batchd_server.catalog", "batchd_server.migrations")


def is_grpc(name: str) -> bool:
    """grpc itself, its companions (``grpc_reflection``, ``grpc_health``, ...) and the
    generated ``*_pb2_grpc`` stubs, which import grpc."""
    parts = name.split(".")
    return (
        parts[0] == "grpc"
        or parts[0].startswith("grpc_")
        or any(part.endswith("_pb2_grpc") for part in parts)
    )


@dataclass(frozen=True)
class ImportRule:
    """Modules for which ``applies`` holds may import no name for which ``forbidden`` holds."""

    says: str
    applies: Callable[[str], bool]
    forbidden: Callable[[str], bool]

    def breaches(self, roots: Iterable[Path]) -> list[str]:
        """Each offending statement: ``path:line: the import (the forbidden names)``."""
        found = []
        for root in roots:
            for module, path in module_names(root).items():
                if not self.applies(module):
                    continue
                for statement in statements_of(module, path):
                    bad = [name for name in statement.names if self.forbidden(name)]
                    if bad:
                        found.append(f"{statement}  ({', '.join(bad)})")
        return found


SERVER_ENTERS_CLIENT_BY_CONTRACT = ImportRule(
    "the server imports of the client distribution only batchd._wire, batchd._proto and "
    "batchd.errors; move what it needs into batchd._wire",
    applies=lambda module: under(module, "batchd_server"),
    forbidden=lambda name: under(name, "batchd") and not under(name, *CLIENT_ENTRANCES),
)
GRPC_ONLY_IN_API = ImportRule(
    "grpc (and the *_pb2_grpc stubs) is imported on the server only under batchd_server.api; "
    "domain code raises batchd_server.errors and api/status.py maps them to status codes",
    applies=lambda module: (
        under(module, "batchd_server") and not under(module, "batchd_server.api")
    ),
    forbidden=is_grpc,
)
API_ONLY_FROM_CLI = ImportRule(
    "only the entry point (batchd_server.cli, batchd_server.cli_serve) imports "
    "batchd_server.api: anything else that "
    "does brings grpc into domain code, and into the decode workers",
    applies=lambda module: (
        under(module, "batchd_server")
        and not under(module, "batchd_server.api", "batchd_server.cli", "batchd_server.cli_serve")
    ),
    forbidden=lambda name: under(name, "batchd_server.api"),
)
SQL_ONLY_IN_CATALOG = ImportRule(
    "SQLAlchemy and alembic are imported only under batchd_server.catalog (and its "
    "migrations), TYPE_CHECKING imports included; type against batchd_server.catalog.db's names",
    applies=lambda module: not under(module, *SQL_HOMES),
    forbidden=lambda name: under(name, *SQL),
)
WIRE_STANDS_ALONE = ImportRule(
    "batchd._wire imports of the client only batchd.errors, batchd._proto and itself, and "
    "neither grpc nor torch: a decode worker imports it",
    applies=lambda module: under(module, "batchd._wire"),
    forbidden=lambda name: (
        (under(name, "batchd") and not under(name, *CLIENT_ENTRANCES))
        or under(name, "batchd_server", "torch")
        or is_grpc(name)
    ),
)

FLOORS = (
    "__init__",
    "errors",
    "limits",
    "logs",
    "settings",
    "metrics",
    "shm",
    "pipelines",
    "storage",
    "parquet",
    "catalog",
    "catalog_cache",
    "planning",
    "cache_policy",
    "decode_cache",
    "workers",
    "sessions",
    "delivery",
    "health",
    "config",
    "assembly",
    "api",
    "demo_data",
    "cli_catalog",
    "cli_serve",
    "cli",
    "migrations",
)
"""batchd_server's rooms from the ground up (rule 7): ``__init__`` is the package's own module
(its version). A room moves only with the imports it has: a room may import those listed
before it, never one after. To add a room, put it above every room it imports and below every
room that imports it."""


@dataclass(frozen=True)
class FloorRule:
    """Under ``package``, a module of room ``rooms[i]`` imports no module of ``rooms[j > i]``,
    and every room is in ``rooms``. A name one level under ``package`` that is neither a
    module of the tree nor a room (``batchd_server.__version__``) is in the package's own
    room, ``__init__``."""

    says: str
    rooms: tuple[str, ...]
    package: str = "batchd_server"

    def breaches(self, roots: Iterable[Path]) -> list[str]:
        """Each import into a higher room or a room on no floor, ``path:line: the import
        (the name: where it is)``, and each module of a room on no floor, ``path: ...``."""
        found = []
        for root in roots:
            modules = module_names(root)
            rooms = {n.split(".")[1] for n in modules if n.startswith(f"{self.package}.")}
            rooms |= set(self.rooms)
            for module, path in modules.items():
                if under(module, self.package):
                    found += self._breaches_of(module, path, rooms)
        return found

    def _room_of(self, name: str, rooms: set[str]) -> str:
        parts = name.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in rooms else "__init__"

    def _breaches_of(self, module: str, path: Path, rooms: set[str]) -> list[str]:
        floor = {room: i for i, room in enumerate(self.rooms)}
        room = self._room_of(module, rooms)
        if room not in floor:
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            return [f"{where}: {room} is on no floor; give it one in FLOORS"]
        found = []
        for statement in statements_of(module, path):
            bad: dict[str, list[str]] = {}  # why -> the names
            for name in statement.names:
                target = self._room_of(name, rooms)
                if not under(name, self.package):
                    continue
                if target not in floor:
                    bad.setdefault(f"{target} is on no floor", []).append(name)
                elif floor[target] > floor[room]:
                    bad.setdefault(f"{target} is above {room}", []).append(name)
            if bad:
                why = "; ".join(f"{', '.join(names)}: {w}" for w, names in bad.items())
                found.append(f"{statement}  ({why})")
        return found


SERVER_FLOORS = FloorRule(
    "an import runs down the server's floors (FLOORS in tests/repo/test_layout.py), never up; "
    "move what the lower room needs down into it, or take a "
    "callback or plain values from the room above (the composition root wires them)",
    FLOORS,
)


class Rule(Protocol):
    @property
    def says(self) -> str: ...

    def breaches(self, roots: Iterable[Path]) -> list[str]: ...


IMPORT_RULES: dict[str, Rule] = {
    "server_enters_client_by_contract": SERVER_ENTERS_CLIENT_BY_CONTRACT,
    "grpc_only_in_api": GRPC_ONLY_IN_API,
    "api_only_from_cli": API_ONLY_FROM_CLI,
    "sql_only_in_catalog": SQL_ONLY_IN_CATALOG,
    "wire_stands_alone": WIRE_STANDS_ALONE,
    "server_floors": SERVER_FLOORS,
}


def _assert_kept(rule: Rule) -> None:
    breaches = rule.breaches(SOURCE_ROOTS)
    assert not breaches, f"{rule.says}:\n" + "\n".join(f"  {b}" for b in breaches)


def test_the_server_enters_the_client_only_through_wire_proto_and_errors() -> None:
    """Rule 1: no batchd_server module imports batchd.<anything else> (Loader, _shm, ...)."""
    _assert_kept(SERVER_ENTERS_CLIENT_BY_CONTRACT)


def test_grpc_reaches_the_server_only_through_its_api_package() -> None:
    """Rule 2: outside batchd_server.api no module imports grpc or a *_pb2_grpc stub, and
    only the cli imports the api; the api itself does import grpc (the check sees it)."""
    _assert_kept(GRPC_ONLY_IN_API)
    _assert_kept(API_ONLY_FROM_CLI)
    in_api = ImportRule("", lambda m: under(m, "batchd_server.api"), is_grpc)
    assert in_api.breaches(SOURCE_ROOTS), "the checker no longer sees the api's grpc imports"


def test_only_the_catalog_and_its_migrations_import_sqlalchemy_or_alembic() -> None:
    """Rule 3: on both distributions, SQLAlchemy and alembic stay under catalog/ and
    migrations/, TYPE_CHECKING imports included."""
    _assert_kept(SQL_ONLY_IN_CATALOG)


def test_the_wire_contract_imports_nothing_of_the_client_but_errors_and_proto() -> None:
    """Rule 6: batchd._wire depends on batchd.errors, batchd._proto, itself and third-party
    code other than grpc and torch."""
    _assert_kept(WIRE_STANDS_ALONE)


def test_the_server_imports_only_down_its_floors() -> None:
    """Rule 7: no module of batchd_server imports a room above its own (TYPE_CHECKING and
    function-level imports included), and every room has a floor."""
    _assert_kept(SERVER_FLOORS)


def test_every_floor_is_a_room_of_the_server_and_the_order_is_what_the_imports_need() -> None:
    """FLOORS names each room once and no room that is gone; the rule sees today's imports
    (the floors upside down break it)."""
    server = SOURCE_ROOTS[0] / "batchd_server"
    rooms = {p.stem for p in server.glob("*.py")} | {
        p.name for p in server.iterdir() if p.is_dir() and any(p.glob("**/*.py"))
    }
    assert len(set(FLOORS)) == len(FLOORS), "a room is on two floors"
    assert set(FLOORS) == rooms, (
        f"rooms on no floor: {sorted(rooms - set(FLOORS))}; "
        f"floors of no room: {sorted(set(FLOORS) - rooms)}"
    )
    upside_down = FloorRule("", tuple(reversed(FLOORS)))
    assert upside_down.breaches(SOURCE_ROOTS), "the floor checker no longer sees the imports"


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


_TC = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
BREACHES: dict[str, tuple[dict[str, str], list[str]]] = {
    "server_enters_client_by_contract": (
        {
            "batchd_server/sessions/a.py": (
                "from batchd._wire.ring import round_up\nfrom batchd import errors\n"
                "from batchd import Loader\n"
            ),
            "batchd_server/workers/b.py": _TC + "    import batchd._loader\n",
            "batchd_server/api/c.py": "from batchd._proto.batchd.v1 import loader_pb2\n",
            "batchd/_loader.py": "from batchd import _shm\n",
        },
        [
            "batchd_server/sessions/a.py:3: from batchd import Loader  (batchd.Loader)",
            "batchd_server/workers/b.py:3: import batchd._loader  (batchd._loader)",
        ],
    ),
    "grpc_only_in_api": (
        {
            "batchd_server/api/servicer.py": "import grpc\n",
            "batchd_server/health.py": "def f():\n    from grpc import StatusCode\n",
            "batchd_server/sessions/s.py": (
                _TC + "    from batchd._proto.batchd.v1 import loader_pb2_grpc\n"
            ),
            "batchd/_loader.py": "import grpc\n",
        },
        [
            "batchd_server/health.py:2: from grpc import StatusCode  (grpc.StatusCode)",
            "batchd_server/sessions/s.py:3: from batchd._proto.batchd.v1 import loader_pb2_grpc"
            "  (batchd._proto.batchd.v1.loader_pb2_grpc)",
        ],
    ),
    "api_only_from_cli": (
        {
            "batchd_server/cli.py": "from batchd_server.api.server import build_server\n",
            "batchd_server/workers/w.py": "from batchd_server.api import status\n",
        },
        [
            "batchd_server/workers/w.py:1: from batchd_server.api import status  "
            "(batchd_server.api.status)"
        ],
    ),
    "sql_only_in_catalog": (
        {
            "batchd_server/catalog/db.py": "import sqlalchemy as sa\n",
            "batchd_server/migrations/versions/0001.py": "from alembic import op\n",
            "batchd_server/catalog_cache.py": _TC + "    from sqlalchemy.engine import Engine\n",
            "batchd/_catalog.py": "import alembic.command\n",
        },
        [
            "batchd/_catalog.py:1: import alembic.command  (alembic.command)",
            "batchd_server/catalog_cache.py:3: from sqlalchemy.engine import Engine  "
            "(sqlalchemy.engine.Engine)",
        ],
    ),
    "wire_stands_alone": (
        {
            "batchd/_wire/status.py": "from batchd import errors\nfrom batchd._wire import ring\n",
            "batchd/_wire/frames.py": "import socket\nfrom google.protobuf.message import Message\n"
            + _TC
            + "    import torch\n",
            "batchd/_wire/ring.py": "def f():\n    from batchd._channel import open_channel\n",
            "batchd/_wire/epoch.py": "from grpc import aio\n",
        },
        [
            "batchd/_wire/epoch.py:1: from grpc import aio  (grpc.aio)",
            "batchd/_wire/frames.py:5: import torch  (torch)",
            "batchd/_wire/ring.py:2: from batchd._channel import open_channel  "
            "(batchd._channel.open_channel)",
        ],
    ),
    "server_floors": (
        {
            "batchd_server/__init__.py": "__version__ = '0'\n",
            "batchd_server/errors.py": "class Fail(Exception): ...\n",
            "batchd_server/metrics/workers.py": (
                "from batchd_server.errors import Fail\n"
                "from batchd_server.workers.task import BatchTask\n"
            ),
            "batchd_server/storage/cache.py": (
                "from batchd_server import __version__, errors\n"
                "from batchd_server.planning.sampling import EpochPlan\n"
            ),
            "batchd_server/planning/sampling.py": (
                "import batchd_server.catalog.types\nfrom batchd_server.storage import cache\n"
            ),
            "batchd_server/sessions/session.py": (
                _TC + "    from batchd_server.delivery import doorbell\n"
            ),
            "batchd_server/sessions/manager.py": "from batchd_server import delivery, workers\n",
            "batchd_server/workers/task.py": (
                "def f():\n    from batchd_server.sessions.options import Options\n"
            ),
            "batchd_server/annex.py": "from batchd_server.errors import Fail\n",
            "batchd_server/api/rpcs.py": "from batchd_server.annex import thing\n",
            "batchd_server/cli.py": (
                "from batchd_server import __version__\nimport batchd_server.api\n"
            ),
            "batchd/_loader.py": "from batchd_server.api import rpcs\n",
        },
        [
            "batchd_server/annex.py: annex is on no floor; give it one in FLOORS",
            "batchd_server/api/rpcs.py:1: from batchd_server.annex import thing  "
            "(batchd_server.annex.thing: annex is on no floor)",
            "batchd_server/metrics/workers.py:2: from batchd_server.workers.task import "
            "BatchTask  (batchd_server.workers.task.BatchTask: workers is above metrics)",
            "batchd_server/sessions/manager.py:1: from batchd_server import delivery, workers  "
            "(batchd_server.delivery: delivery is above sessions)",
            "batchd_server/sessions/session.py:3: from batchd_server.delivery import doorbell  "
            "(batchd_server.delivery.doorbell: delivery is above sessions)",
            "batchd_server/storage/cache.py:2: from batchd_server.planning.sampling import "
            "EpochPlan  (batchd_server.planning.sampling.EpochPlan: planning is above storage)",
            "batchd_server/workers/task.py:2: from batchd_server.sessions.options import "
            "Options  (batchd_server.sessions.options.Options: sessions is above workers)",
        ],
    ),
}


@pytest.mark.parametrize("rule_name", sorted(IMPORT_RULES))
def test_each_import_rule_names_every_breach_in_a_tree_that_has_one(
    rule_name: str, tmp_path: Path
) -> None:
    """The checkers themselves: over a small tree in tmp_path with breaches at the top, under
    TYPE_CHECKING and inside functions, each rule reports exactly those, by file:line and
    statement, and nothing that keeps it."""
    files, expected = BREACHES[rule_name]
    _write_tree(tmp_path, files)
    found = IMPORT_RULES[rule_name].breaches([tmp_path])
    assert [b.removeprefix(f"{tmp_path}/") for b in found] == expected


# -- rule 4: segments are created and unlinked only in shm/ ---------------------------------

SHM_HOME = "batchd_server.shm"
_SHM_WORDS = ("shm", "segment")
_ALWAYS = {
    "posix_fallocate": "reserves a segment's pages",
    "shm_open": "creates a segment",
    "shm_unlink": "unlinks a segment",
    "SharedMemory": "makes a segment that the resource tracker may unlink",
    "ShareableList": "makes a segment that the resource tracker may unlink",
}
"""Calls that touch shared memory whatever their arguments. ``SharedMemory`` counts even
without ``create=True``: on Python 3.11 attaching registers the name with the resource
tracker, which unlinks it when the attaching process exits."""
_CREATES = ("touch", "write_bytes", "write_text")


def _tags(expr: ast.AST, tainted: dict[str, set[str]]) -> set[str]:
    """What ``expr`` may be: "shm" (a path in /dev/shm or of a segment), "creat" (flags with
    O_CREAT). A name or attribute tells by its spelling or by what was assigned to it."""
    tags: set[str] = set()
    for node in ast.walk(expr):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "/dev/shm" in node.value:
                tags.add("shm")
        elif isinstance(node, ast.Name | ast.Attribute):
            spelled = node.id if isinstance(node, ast.Name) else node.attr
            if any(word in spelled.lower() for word in _SHM_WORDS):
                tags.add("shm")
            if spelled == "O_CREAT":
                tags.add("creat")
            tags |= tainted.get(ast.unparse(node), set())
    return tags


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope``, not descending into nested functions and classes."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield from _own_nodes(child)


def _assignments(node: ast.AST) -> list[tuple[ast.expr, ast.expr]]:
    if isinstance(node, ast.Assign):
        return [(target, node.value) for target in node.targets]
    if isinstance(node, ast.AnnAssign | ast.AugAssign) and node.value is not None:
        return [(node.target, node.value)]
    if isinstance(node, ast.NamedExpr):
        return [(node.target, node.value)]
    if isinstance(node, ast.For | ast.AsyncFor):
        return [(node.target, node.iter)]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [(node.optional_vars, node.context_expr)]
    return []


def _taint(scope: ast.AST, inherited: dict[str, set[str]]) -> dict[str, set[str]]:
    """``inherited`` plus what assignments in ``scope`` tag, to a fixed point."""
    tainted = {key: set(tags) for key, tags in inherited.items()}
    pairs = [pair for node in _own_nodes(scope) for pair in _assignments(node)]
    changed = True
    while changed:
        changed = False
        for target, value in pairs:
            tags = _tags(value, tainted)
            elements = target.elts if isinstance(target, ast.Tuple | ast.List) else [target]
            for element in elements:
                key = ast.unparse(element)
                if not tags <= tainted.get(key, set()):
                    tainted[key] = tainted.get(key, set()) | tags
                    changed = True
    return tainted


def _operation(call: ast.Call, tainted: dict[str, set[str]]) -> str | None:
    """What ``call`` does to a segment, or None if it creates and unlinks none."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    on = ast.unparse(func.value) if isinstance(func, ast.Attribute) else None
    args = call.args
    if name in _ALWAYS:
        return _ALWAYS[name]
    first_shm = bool(args) and "shm" in _tags(args[0], tainted)
    if name == "open" and on == "os" and len(args) >= 2 and first_shm:
        return "creates a file in /dev/shm" if "creat" in _tags(args[1], tainted) else None
    if name == "open" and on is None and first_shm:
        modes = [*args[1:2], *(k.value for k in call.keywords if k.arg == "mode")]
        mode = modes[0] if modes else None
        if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wxa"):
            return "creates a file in /dev/shm"
        return None
    if name in ("unlink", "remove", "rmtree") and on in ("os", "shutil") and first_shm:
        return "unlinks a file in /dev/shm"
    on_shm_path = (
        isinstance(func, ast.Attribute)
        and on not in ("os", "shutil")
        and "shm" in _tags(func.value, tainted)
    )
    if on_shm_path and name == "unlink":
        return "unlinks a file in /dev/shm"
    if on_shm_path and name in _CREATES:
        return "creates a file in /dev/shm"
    return None


def segment_operations(path: Path) -> list[tuple[int, str, str]]:
    """``(line, call, what it does)`` for each call in ``path`` that creates or unlinks a
    segment or another file in /dev/shm (see ``_operation``).

    A path counts as one in /dev/shm when its expression says so: a name or attribute
    spelled with "shm" or "segment", "/dev/shm", or a variable (``self.<attribute>`` across
    a class's methods) assigned from such an expression. A path handed to a helper under a
    neutral parameter name is not followed into the helper.
    """
    found: list[tuple[int, str, str]] = []

    def scan(scope: ast.AST, inherited: dict[str, set[str]]) -> None:
        tainted = _taint(scope, inherited)
        for node in _own_nodes(scope):
            if isinstance(node, ast.Call) and (what := _operation(node, tainted)):
                written = ast.get_source_segment(source, node) or ast.unparse(node)
                found.append((node.lineno, " ".join(written.split()), what))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                scan(node, tainted)
            elif isinstance(node, ast.ClassDef):
                scan_class(node, tainted)

    def scan_class(cls: ast.ClassDef, inherited: dict[str, set[str]]) -> None:
        methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        shared = dict(inherited)
        while True:  # self.<attribute> tagged in one method is tagged in all of them
            grown = dict(shared)
            for method in methods:
                for key, tags in _taint(method, shared).items():
                    if key.startswith("self."):
                        grown[key] = grown.get(key, set()) | tags
            if grown == shared:
                break
            shared = grown
        scan(cls, shared)

    source = path.read_text()
    scan(ast.parse(source, str(path)), {})
    return sorted(found)


def segment_breaches(roots: Iterable[Path]) -> list[str]:
    """Each call outside batchd_server.shm that creates or unlinks a segment: ``path:line``."""
    found = []
    for root in roots:
        for module, path in module_names(root).items():
            if under(module, SHM_HOME):
                continue
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            found += [
                f"{where}:{line}: {call}  ({what})" for line, call, what in segment_operations(path)
            ]
    return found


def test_only_shm_creates_or_unlinks_shared_memory_segments() -> None:
    """Rule 4: no module of either distribution outside batchd_server.shm creates, reserves or
    unlinks a file in /dev/shm (os.open with O_CREAT, posix_fallocate, SharedMemory, unlink)."""
    breaches = segment_breaches(SOURCE_ROOTS)
    assert not breaches, (
        "only batchd_server.shm creates or unlinks segments; ask its ShmRegistry instead:\n"
        + "\n".join(f"  {b}" for b in breaches)
    )


def test_the_segment_check_recognises_how_shm_creates_and_unlinks_segments_today() -> None:
    """The check sees shm/'s own ways: the O_CREAT open of a segment and of the instance
    lock, posix_fallocate, and the sweep's unlinks of segments and lock files."""
    shm = REPO / "server/src/batchd_server/shm"
    seen = {
        (name, call.split("(")[0])
        for name in ("registry.py", "instance.py")
        for _, call, _ in segment_operations(shm / name)
    }
    assert {
        ("registry.py", "os.open"),
        ("registry.py", "os.posix_fallocate"),
        ("instance.py", "os.open"),
        ("instance.py", "os.unlink"),
        ("instance.py", "lock_path.unlink"),
    } <= seen


LEAK = """\
import os
import shutil
from multiprocessing import shared_memory
from pathlib import Path

from batchd_server.shm import SHM_DIR


def make(name, nbytes):
    path = SHM_DIR / name
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
    fd = os.open(path, flags, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    with open(Path("/dev/shm") / name, "wb") as out:
        out.write(b"x")
    return shared_memory.SharedMemory(name=name, create=True, size=nbytes)


def drop(segment, config):
    segment.path.unlink(missing_ok=True)
    os.unlink(config.shm_dir / "batchd-0")
    shutil.rmtree("/dev/shm/batchd")


class Holder:
    def __init__(self, base):
        self.file = base.shm_dir / "batchd-1"

    def close(self):
        self.file.unlink()


def harmless(path, items, shm_dir):
    os.close(os.open(shm_dir / "batchd-2", os.O_RDONLY))
    Path(path).unlink()
    items.remove(3)
    with open(shm_dir / "batchd-3", "rb") as f:
        return f.read()
"""
"""Every way of touching a segment that the check knows, and (``harmless``) what it must let
pass: attaching read-only, unlinking a path outside /dev/shm, ``list.remove``."""


def test_the_segment_check_names_every_breach_in_a_tree_that_has_them(tmp_path: Path) -> None:
    """Outside shm/ each way of creating, reserving or unlinking a segment is reported by
    file:line and call; the same code inside batchd_server.shm is not."""
    _write_tree(tmp_path, {"batchd_server/sessions/leak.py": LEAK, "batchd_server/shm/ok.py": LEAK})
    found = [b.removeprefix(f"{tmp_path}/") for b in segment_breaches([tmp_path])]
    lines = [int(b.split(":")[1]) for b in found]
    assert lines == [12, 13, 14, 16, 20, 21, 22, 30], "\n".join(found)
    assert found[0] == (
        "batchd_server/sessions/leak.py:12: os.open(path, flags, 0o600)  "
        "(creates a file in /dev/shm)"
    )
