"""Security settings: flags and BATCHD_* variables reach ServerConfig, and incomplete TLS
settings are refused with the flags named."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchd_server.cli import build_parser
from batchd_server.config import ServerConfig


def test_tls_token_and_insecure_come_from_the_environment() -> None:
    """BATCHD_TLS_CERT, _TLS_KEY, _TLS_CLIENT_CA, _AUTH_TOKEN_FILE and _INSECURE."""
    env = {
        "BATCHD_DATABASE_URL": "sqlite:///x.db",
        "BATCHD_TLS_CERT": "/etc/batchd/cert.pem",
        "BATCHD_TLS_KEY": "/etc/batchd/key.pem",
        "BATCHD_TLS_CLIENT_CA": "/etc/batchd/ca.pem",
        "BATCHD_AUTH_TOKEN_FILE": "/run/secrets/token",
        "BATCHD_INSECURE": "true",
    }
    config = ServerConfig.from_env(env)
    assert config.tls_cert == Path("/etc/batchd/cert.pem")
    assert config.tls_key == Path("/etc/batchd/key.pem")
    assert config.tls_client_ca == Path("/etc/batchd/ca.pem")
    assert config.auth_token_file == Path("/run/secrets/token")
    assert config.insecure is True
    assert ServerConfig.from_env({**env, "BATCHD_INSECURE": "0"}).insecure is False
    with pytest.raises(ValueError, match="BATCHD_INSECURE='maybe'"):
        ServerConfig.from_env({**env, "BATCHD_INSECURE": "maybe"})


def test_a_certificate_without_its_key_or_a_client_ca_without_tls_is_refused() -> None:
    """Half a TLS setup is an error naming the flags, not a plaintext server."""
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        ServerConfig(database_url="sqlite:///x.db", tls_cert=Path("c.pem"))
    with pytest.raises(ValueError, match="--tls-client-ca"):
        ServerConfig(database_url="sqlite:///x.db", tls_client_ca=Path("ca.pem"))


def test_serve_flags_for_tls_token_and_insecure_parse() -> None:
    """The serve subcommand has each flag."""
    args = build_parser().parse_args(
        [
            "serve",
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--tls-client-ca",
            "ca.pem",
            "--auth-token-file",
            "t",
            "--insecure",
        ]
    )
    assert (args.tls_cert, args.tls_key, args.tls_client_ca) == (
        Path("c.pem"),
        Path("k.pem"),
        Path("ca.pem"),
    )
    assert args.auth_token_file == Path("t") and args.insecure is True
