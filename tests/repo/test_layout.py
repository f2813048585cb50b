"""The layout's rules, checked on the source: who may import what (and, in
``test_shm_segments.py``, who may touch /dev/shm).

1. The server enters the client distribution only through ``batchd._wire``, ``batchd._proto``
   and ``batchd.errors`` (Python runs the package ``batchd`` first, as their parent).
2. grpc reaches the server only through ``batchd_server.api``, which only the entry point
   (``batchd_server.cli`` and ``cli_serve``) imports: domain code and the decode workers
   never load it.
3. SQLAlchemy and alembic are imported only by ``batchd_server.catalog`` and its migrations.
4. Only ``batchd_server.shm`` creates or unlinks shared-memory segments:
   ``test_shm_segments.py``.
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

from collections.abc import Callable, Iterable
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
    "settings",
    "limits",
    "logs",
    "service_settings",
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


SERVICE_TESTS = "service"
"""The folder of ``tests/server/`` for the rooms a server is run by (its commands, settings,
health, admission and shutdown: ``config``, ``cli*``, ``api``, ``health``, ``demo_data``)."""


def test_the_servers_tests_sit_in_the_room_they_test() -> None:
    """``tests/server/<room>/``: each server test file is in a folder named after one of the
    server's rooms (:data:`FLOORS`) or ``service``, so a room's tests are found beside each
    other; none lies loose at the top."""
    server_tests = REPO / "tests" / "server"
    misplaced = [
        str(path.relative_to(REPO))
        for path in sorted(server_tests.rglob("test_*.py"))
        if path.parent.parent != server_tests or path.parent.name not in (*FLOORS, SERVICE_TESTS)
    ]
    assert not misplaced, (
        "put each server test in tests/server/<room>/, the room it tests:\n  "
        + "\n  ".join(misplaced)
    )
    assert len(list(server_tests.rglob("test_*.py"))) > 40
