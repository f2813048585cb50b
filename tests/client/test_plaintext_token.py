"""A bearer token sent in plaintext to another machine is named in a warning, once per
target; TLS, a unix socket or loopback send nothing to warn about."""

from __future__ import annotations

import logging

import pytest

from batchd._channel import ChannelSecurity, open_channel


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "plaintext" in r.getMessage()]


def test_a_token_over_plaintext_tcp_to_another_host_is_warned_of_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning names the target and the remedy (TLS or a unix socket), and a second
    channel to the same target does not repeat it."""
    caplog.set_level(logging.WARNING, logger="batchd")
    security = ChannelSecurity.resolve(auth_token="s3cret", environ={})
    for _ in range(2):
        open_channel("batchd-pool.example:50051", security).close()
    (warning,) = _warnings(caplog)
    assert "'batchd-pool.example:50051'" in warning and "--tls-cert" in warning
    assert "s3cret" not in warning


@pytest.mark.parametrize(
    "target", ["unix:///run/batchd.sock", "127.0.0.1:50051", "localhost:50051", "[::1]:50051"]
)
def test_a_token_to_this_machine_is_not_warned_of(
    caplog: pytest.LogCaptureFixture, target: str
) -> None:
    """A unix socket or a loopback address never leaves the machine."""
    caplog.set_level(logging.WARNING, logger="batchd")
    open_channel(target, ChannelSecurity.resolve(auth_token="s3cret", environ={})).close()
    assert _warnings(caplog) == []


def test_no_token_means_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Without a token there is nothing on the wire to protect."""
    caplog.set_level(logging.WARNING, logger="batchd")
    open_channel("other-host.example:50051", ChannelSecurity.resolve(environ={})).close()
    assert _warnings(caplog) == []
