"""The catalog's server settings: where the catalog database is."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from batchd_server.settings import EVERY_COMMAND, Check, setting

__all__ = ["CatalogSettings", "batchd_home", "default_database_url"]


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


def _url_problem(url: str) -> str | None:
    scheme = url.split(":", 1)[0]
    if scheme.startswith("postgresql") or scheme.startswith("sqlite"):
        return None
    return (
        f"has the scheme {scheme!r}, which batchd does not support; use postgresql://... "
        "or sqlite:///path"
    )


@dataclass(frozen=True, kw_only=True)
class CatalogSettings:
    """The catalog's settings."""

    database_url: str = setting(
        flag="--database-url",
        default_factory=default_database_url,
        check=Check("postgresql://... or sqlite:///...", _url_problem),
        help="SQLAlchemy URL of the catalog: postgresql://... or sqlite:///path",
        metavar="URL",
        default_text="a SQLite file catalog.db under $BATCHD_HOME",
        default_in=default_database_url,
        commands=(EVERY_COMMAND,),
        secret=True,
    )
