"""Server configuration, read from the environment in exactly one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ServerConfig", "batchd_home", "default_database_url"]


def batchd_home(environ: Mapping[str, str] | None = None) -> Path:
    """Where batchd keeps local state: ``$BATCHD_HOME``, else ``$XDG_DATA_HOME/batchd``,
    else ``~/.local/share/batchd``."""
    env = os.environ if environ is None else environ
    if env.get("BATCHD_HOME"):
        return Path(env["BATCHD_HOME"]).expanduser()
    xdg = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg).expanduser() / "batchd"


def default_database_url(environ: Mapping[str, str] | None = None) -> str:
    """The embedded default catalog: a SQLite file ``catalog.db`` under :func:`batchd_home`."""
    path = (batchd_home(environ) / "catalog.db").resolve()
    return f"sqlite:///{path}"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Everything the server needs to know, validated on construction."""

    database_url: str = field(default_factory=default_database_url)
    """SQLAlchemy URL of the catalog (``postgresql+psycopg2://...`` or ``sqlite:///...``)."""

    def __post_init__(self) -> None:
        scheme = self.database_url.split(":", 1)[0]
        if not (scheme.startswith("postgresql") or scheme.startswith("sqlite")):
            raise ValueError(
                f"database URL scheme {scheme!r} is not supported; use postgresql://... "
                "or sqlite:///path (set BATCHD_DATABASE_URL)"
            )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: object
    ) -> ServerConfig:
        """Build a config from ``BATCHD_*`` variables; keyword overrides win."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {
            "database_url": env.get("BATCHD_DATABASE_URL") or default_database_url(env),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
