"""Server settings are declared once, on the fields of each feature's settings dataclass,
composed into ServerConfig: the committed reference page, the flags, the variables, the
defaults the help shows and the errors all follow from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from batchd_server.cli import build_parser, main
from batchd_server.config import REGENERATE_DOC, ServerConfig, settings_table
from batchd_server.settings import EVERY_COMMAND, declared, default_text, given
from batchd_server.workers.sizing import WorkerRange

REPO = Path(__file__).resolve().parents[3]
PAGE = REPO / "docs" / "reference" / "server-settings.md"

PINNED: dict[str, tuple[str | None, str, Any]] = {
    "database_url": ("--database-url", "BATCHD_DATABASE_URL", None),
    "listen": ("--listen", "BATCHD_LISTEN", "127.0.0.1:50051"),
    "workers": ("--workers", "BATCHD_WORKERS", None),
    "shm_budget_bytes": ("--shm-budget", "BATCHD_SHM_BUDGET", 1 << 30),
    "lease_timeout_s": ("--lease-timeout-s", "BATCHD_LEASE_TIMEOUT_S", 30.0),
    "metrics_port": ("--metrics-port", "BATCHD_METRICS_PORT", None),
    "metrics_listen": ("--metrics-listen", "BATCHD_METRICS_LISTEN", None),
    "max_sessions": ("--max-sessions", "BATCHD_MAX_SESSIONS", 256),
    "max_concurrent_rpcs": ("--max-concurrent-rpcs", "BATCHD_MAX_CONCURRENT_RPCS", 128),
    "client_max_calls": ("--client-max-calls", "BATCHD_CLIENT_MAX_CALLS", 32),
    "client_max_sessions": ("--client-max-sessions", "BATCHD_CLIENT_MAX_SESSIONS", 64),
    "client_shm_quota_bytes": ("--client-shm-quota", "BATCHD_CLIENT_SHM_QUOTA", None),
    "client_plan_quota_bytes": ("--client-plan-quota", "BATCHD_CLIENT_PLAN_QUOTA", 8 << 30),
    "share_loan_timeout_s": ("--share-loan-timeout-s", "BATCHD_SHARE_LOAN_TIMEOUT_S", 300.0),
    "shm_dir": ("--shm-dir", "BATCHD_SHM_DIR", Path("/dev/shm")),
    "min_free_shm_bytes": ("--min-free-shm", "BATCHD_MIN_FREE_SHM", 56 << 20),
    "grace_s": ("--grace-s", "BATCHD_GRACE_S", 20.0),
    "health_interval_s": (None, "BATCHD_HEALTH_INTERVAL_S", 2.0),
    "catalog_timeout_s": (None, "BATCHD_CATALOG_TIMEOUT_S", 5.0),
    "log_format": ("--log-format", "BATCHD_LOG_FORMAT", "text"),
    "tls_cert": ("--tls-cert", "BATCHD_TLS_CERT", None),
    "tls_key": ("--tls-key", "BATCHD_TLS_KEY", None),
    "tls_client_ca": ("--tls-client-ca", "BATCHD_TLS_CLIENT_CA", None),
    "healthcheck_tls_ca": ("--tls-ca", "BATCHD_TLS_CA", None),
    "healthcheck_tls_client_cert": ("--tls-client-cert", "BATCHD_TLS_CLIENT_CERT", None),
    "healthcheck_tls_client_key": ("--tls-client-key", "BATCHD_TLS_CLIENT_KEY", None),
    "auth_token_file": ("--auth-token-file", "BATCHD_AUTH_TOKEN_FILE", None),
    "insecure": ("--insecure", "BATCHD_INSECURE", False),
    "data_roots": ("--data-root", "BATCHD_DATA_ROOTS", ()),
    "task_timeout_s": ("--task-timeout-s", "BATCHD_TASK_TIMEOUT_S", 60.0),
    "max_sample_bytes": ("--max-sample-bytes", "BATCHD_MAX_SAMPLE_BYTES", 256 << 20),
    "decode_cache_bytes": ("--decode-cache-size", "BATCHD_DECODE_CACHE_SIZE", 0),
    "decode_cache_dir": ("--decode-cache-dir", "BATCHD_DECODE_CACHE_DIR", None),
    "decode_cache_dir_bytes": ("--decode-cache-dir-size", "BATCHD_DECODE_CACHE_DIR_SIZE", 0),
    "object_store_retry_s": ("--object-store-retry-s", "BATCHD_OBJECT_STORE_RETRY_S", 30.0),
    "object_store_list_cache_s": (
        "--object-store-list-cache-s",
        "BATCHD_OBJECT_STORE_LIST_CACHE_S",
        5.0,
    ),
    "reflection": ("--reflection", "BATCHD_REFLECTION", False),
    "heartbeat_interval_s": ("--heartbeat-interval-s", "BATCHD_HEARTBEAT_INTERVAL_S", 5.0),
    "cache_dir": ("--cache-dir", "BATCHD_CACHE_DIR", None),
    "cache_size_bytes": ("--cache-size", "BATCHD_CACHE_SIZE", 10 << 30),
    "cache_prefetch_batches": ("--cache-prefetch-batches", "BATCHD_CACHE_PREFETCH_BATCHES", 8),
}
"""Every setting's flag, variable and default as operators and deployments know them."""

SAMPLES: dict[str, tuple[str, Any]] = {
    "database_url": ("sqlite:////tmp/s.db", "sqlite:////tmp/s.db"),
    "listen": ("unix:///run/b.sock", "unix:///run/b.sock"),
    "shm_budget_bytes": ("2GiB", 2 << 30),
    "client_shm_quota_bytes": ("64MiB", 64 << 20),
    "client_plan_quota_bytes": ("2GiB", 2 << 30),
    "min_free_shm_bytes": ("1GiB", 1 << 30),
    "metrics_listen": ("0.0.0.0:9400", "0.0.0.0:9400"),
    "log_format": ("json", "json"),
    "insecure": ("1", True),
    "reflection": ("1", True),
    "max_sample_bytes": ("64MiB", 64 << 20),
    "data_roots": ("/data", (Path("/data"),)),
    "cache_dir": ("/var/cache/batchd", Path("/var/cache/batchd")),
    "cache_size_bytes": ("20GiB", 20 << 30),
    "workers": ("2..6", WorkerRange(2, 6)),
    "decode_cache_bytes": ("8GiB", 8 << 30),
    "decode_cache_dir_bytes": ("100GiB", 100 << 30),
}
"""A valid text for each setting whose type alone does not give one."""

_TLS = {"BATCHD_TLS_CERT": "/etc/batchd/c.pem", "BATCHD_TLS_KEY": "/etc/batchd/k.pem"}
COMPANIONS: dict[str, dict[str, str]] = {"tls_cert": _TLS, "tls_key": _TLS, "tls_client_ca": _TLS}
COMPANIONS["decode_cache_dir"] = {"BATCHD_DECODE_CACHE_SIZE": "1GiB"}
"""Variables a setting is only valid with (TLS comes as a certificate and its key)."""

BAD: dict[str, Any] = {
    "database_url": "mysql://u:pw@h/db",
    "metrics_listen": "9400",
    "log_format": "xml",
    "data_roots": (Path("relative"),),
    "cache_dir": Path("relative"),
    "workers": WorkerRange(3, 2),
}
"""A value each non-numeric check refuses (every numeric one refuses -1)."""


def _sample(field: dataclasses.Field[Any]) -> tuple[str, Any]:
    if field.name in SAMPLES:
        return SAMPLES[field.name]
    kind = str(field.type)
    if "Path" in kind:
        return "/etc/batchd/x.pem", Path("/etc/batchd/x.pem")
    return ("7", 7) if "int" in kind else ("7.5", 7.5)


def test_the_committed_settings_page_is_the_one_the_declarations_generate() -> None:
    """docs/reference/server-settings.md is settings_table()'s output, byte for byte."""
    assert PAGE.read_text() == settings_table(), (
        f"{PAGE.relative_to(REPO)} is stale; regenerate it with: {REGENERATE_DOC}"
    )


def test_every_setting_keeps_its_flag_variable_and_default() -> None:
    """The declarations say what deployments rely on: the same names and the same defaults."""
    found = {f.name: (s.flag, s.env, f.default) for f, s in declared(ServerConfig)}
    assert found.keys() == PINNED.keys()
    for name, (flag, env, default) in PINNED.items():
        got_flag, got_env, got_default = found[name]
        assert (got_flag, got_env) == (flag, env), name
        if default is not None:
            assert got_default == default, name


@pytest.mark.parametrize("name", list(PINNED))
def test_each_flag_and_variable_sets_its_field_on_each_command_that_takes_it(name: str) -> None:
    """The variable sets the field; the flag does too on every command it is declared for,
    and wins over the variable."""
    field, setting = next((f, s) for f, s in declared(ServerConfig) if f.name == name)
    text, value = _sample(field)
    assert setting.env is not None
    url = {"BATCHD_DATABASE_URL": "sqlite:///x.db", **COMPANIONS.get(name, {})}
    assert getattr(ServerConfig.from_env({**url, setting.env: text}), name) == value
    if setting.flag is None:
        return
    commands = ["serve", "healthcheck", "datasets"] if EVERY_COMMAND in setting.commands else []
    for command in commands or setting.commands:
        argv = [command, setting.flag] + ([] if value is True else [text])
        args = build_parser().parse_args(argv)
        config = ServerConfig.from_env({**url, setting.env: ""}, **given(args, ServerConfig))
        assert getattr(config, name) == value, (command, argv)


def test_the_default_each_help_shows_reads_back_as_the_fields_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Help and page show defaults from the field, in a form the flag accepts again."""
    shown = 0
    for field, setting in declared(ServerConfig):
        if setting.default_text is None and field.default not in (None, ()):
            assert setting.parse_env(default_text(field, setting)) == field.default, field.name
            shown += 1
    assert shown >= 15
    assert main(["serve", "--help"]) == 0
    assert "(default: 1GiB; $BATCHD_SHM_BUDGET)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("name", [f.name for f, s in declared(ServerConfig) if s.check is not None])
def test_a_value_its_rule_refuses_is_an_error_naming_the_flag_and_the_variable(name: str) -> None:
    """ServerConfig(name=bad) raises a ValueError that names the flag and the variable."""
    setting = next(s for f, s in declared(ServerConfig) if f.name == name)
    fields = {"database_url": "sqlite:///x.db", name: BAD.get(name, -1)}
    with pytest.raises(ValueError) as raised:
        ServerConfig(**fields)
    message = str(raised.value)
    for part in (setting.flag, setting.env):
        assert part is None or part in message, message
    assert "pw" not in message, "a database URL's password never reaches a message"


def test_every_features_settings_are_composed_into_server_config() -> None:
    """A dataclass of settings declared anywhere in the server is a base of ServerConfig, so
    its flags, variables and reference rows exist (a feature that forgot config.py would
    have settings no operator can set)."""
    import importlib
    import inspect
    import pkgutil

    import batchd_server

    found = set()
    for info in pkgutil.walk_packages(batchd_server.__path__, "batchd_server."):
        if ".migrations" in info.name:
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                cls.__module__ == info.name
                and dataclasses.is_dataclass(cls)
                and any(True for _ in declared(cls))
            ):
                found.add(cls)
    found.discard(ServerConfig)
    assert len(found) >= 8, found
    assert {cls for cls in found if not issubclass(ServerConfig, cls)} == set()


def test_reading_the_configuration_loads_neither_sqlalchemy_nor_grpc() -> None:
    """Every command, ``--help`` included, reads the configuration: composing the features'
    settings must not pull in the catalog's database layer or the gRPC service."""
    import subprocess
    import sys

    code = (
        "import sys, batchd_server.config\n"
        "print(' '.join(m for m in ('sqlalchemy', 'grpc', 'pyarrow') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""
