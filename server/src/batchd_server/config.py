"""Server configuration: every feature's settings composed into one :class:`ServerConfig`,
read from the environment in exactly one place (:meth:`ServerConfig.from_env`).

Each feature declares its settings beside its code, one frozen dataclass of fields that
carry their flag, environment variable, help, parser and check (:mod:`batchd_server.settings`):
``catalog/settings.py``, ``service_settings.py`` (addresses, security, calls, health and
the sessions' limits), ``shm/settings.py``, ``workers/settings.py``,
``storage/settings.py``, ``decode_cache/settings.py`` and ``logs.py``. ServerConfig inherits
them all and adds only the checks that span them; the command line, the environment loader,
the checks and the reference page ``docs/reference/server-settings.md`` are derived from the
declarations. A new feature's settings are one more base here. Regenerate the page after
changing a setting::

    python -m batchd_server.config > docs/reference/server-settings.md
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields

from batchd_server.catalog.settings import CatalogSettings, batchd_home, default_database_url
from batchd_server.decode_cache.settings import DecodeCacheSettings
from batchd_server.logs import LOG_FORMATS, LogSettings
from batchd_server.service_settings import (
    DEFAULT_GRACE_S,
    DEFAULT_LISTEN,
    ServiceSettings,
    SessionSettings,
    reserved_rpcs,
)
from batchd_server.settings import (
    check_values,
    from_environ,
    markdown_table,
    parse_bool,
    parse_bytes,
    split_host_port,
)
from batchd_server.shm.settings import DEFAULT_MIN_FREE_SHM_BYTES, ShmLimits, ShmSettings
from batchd_server.storage.settings import StorageSettings
from batchd_server.workers.settings import WorkerSettings
from batchd_server.workers.sizing import available_cpus

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_LISTEN",
    "DEFAULT_MIN_FREE_SHM_BYTES",
    "LOG_FORMATS",
    "REGENERATE_DOC",
    "ServerConfig",
    "ShmLimits",
    "available_cpus",
    "batchd_home",
    "default_database_url",
    "parse_bool",
    "parse_bytes",
    "reserved_rpcs",
    "settings_table",
    "split_host_port",
]

REGENERATE_DOC = "python -m batchd_server.config > docs/reference/server-settings.md"
"""The command that writes the settings reference page from the declarations."""


@dataclass(frozen=True, kw_only=True)
class ServerConfig(
    DecodeCacheSettings,
    StorageSettings,
    WorkerSettings,
    LogSettings,
    ServiceSettings,
    ShmSettings,
    SessionSettings,
    CatalogSettings,
):
    """Everything the server needs to know, validated on construction: each base is one
    feature's settings (the last base's come first on the reference page and in ``--help``).

    Each field's ``setting(...)`` says what it does, how to set it and what it allows; the
    reference page (:func:`settings_table`) shows them all.
    """

    def __post_init__(self) -> None:
        self.check_workers()
        check_values(self)
        self.check_service()
        self.check_decode_cache()

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: object
    ) -> ServerConfig:
        """Build a config from each setting's ``BATCHD_*`` variable (``environ``, default
        ``os.environ``; an empty variable is unset); keyword overrides (not None) win.

        Raises:
            ValueError: a variable does not parse, or a value breaks its rule; the message
                names the variable or the flag.
        """
        env = os.environ if environ is None else environ
        values = from_environ(cls, env)
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        assert not unknown, f"unknown ServerConfig fields {unknown}"
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def settings_table() -> str:
    """The settings reference page (Markdown), generated from :class:`ServerConfig`'s
    declarations; committed as ``docs/reference/server-settings.md``."""
    return f"""# Server settings

<!-- Generated from ServerConfig in server/src/batchd_server/config.py; do not edit.
     Regenerate with: {REGENERATE_DOC} -->

Every setting of `batchd-server` can be given as a flag or as an environment variable;
a flag wins over its variable, and an empty variable counts as unset. Flags go to `serve`
unless the table names other commands. Sizes in bytes read `1073741824`, `512MiB`, `2GiB`
or `1.5GB`; booleans `1`/`0`, `true`/`false`, `yes`/`no` or `on`/`off`. A value outside
*Allowed* stops the server with a message that names the flag and the variable.

{markdown_table(ServerConfig)}"""


if __name__ == "__main__":
    sys.stdout.write(settings_table())
