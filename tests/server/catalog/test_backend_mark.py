"""The ``backend`` mark (``tests/conftest.py``): a marked test gets its catalog on the one
backend it names, and runs once, not once per backend."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import Engine


@pytest.mark.backend("sqlite")
def test_a_test_marked_sqlite_runs_once_on_the_embedded_catalog(
    engine: Engine, request: pytest.FixtureRequest
) -> None:
    assert engine.dialect.name == "sqlite"
    assert request.node.callspec.params == {"catalog_url": "sqlite"}


@pytest.mark.backend("postgres")
def test_a_test_marked_postgres_runs_once_on_postgres(
    engine: Engine, request: pytest.FixtureRequest
) -> None:
    assert engine.dialect.name == "postgresql"
    assert request.node.callspec.params == {"catalog_url": "postgres"}


def test_an_unmarked_catalog_test_runs_on_both_backends(
    engine: Engine, request: pytest.FixtureRequest
) -> None:
    backend = request.node.callspec.params["catalog_url"]
    assert engine.dialect.name == {"sqlite": "sqlite", "postgres": "postgresql"}[backend]
