"""Which targets a Loader stripes over: a list of replicas, or every address of a DNS name;
anything naming one server is one replica (with its exact target string)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from batchd._channel import ChannelSecurity
from batchd._options import LoaderOptions
from batchd._replicas import Replicas
from batchd._targets import ReplicaAddresses, replicas_of
from batchd.errors import InvalidArgument


def _resolver(*ips: str) -> Any:
    """A stand-in for ``socket.getaddrinfo`` answering ``ips`` for every name."""

    def resolve(host: str, port: int, **_: Any) -> list[tuple[Any, ...]]:
        out = []
        for ip in ips:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            sockaddr = (ip, port, 0, 0) if family == socket.AF_INET6 else (ip, port)
            out.append((family, socket.SOCK_STREAM, 6, "", sockaddr))
        return out

    return resolve


def test_a_dns_name_with_several_addresses_becomes_one_replica_each_in_order() -> None:
    """A and AAAA records become ``ip:port`` and ``[ip]:port`` replicas, once each, in the
    resolver's order; the name is kept for resolving again and for TLS."""
    got = replicas_of(
        "dns:///batchd-headless:50051",
        resolver=_resolver("10.0.0.7", "10.0.0.8", "10.0.0.7", "fd00::9"),
    )
    assert got == ReplicaAddresses(
        ("10.0.0.7:50051", "10.0.0.8:50051", "[fd00::9]:50051"), "batchd-headless", 50051
    )
    assert replicas_of(
        "dns:pool:7000", resolver=_resolver("1.2.3.4", "1.2.3.5")
    ) == ReplicaAddresses(("1.2.3.4:7000", "1.2.3.5:7000"), "pool", 7000)


def test_anything_naming_one_server_stays_the_single_target_it_was() -> None:
    """One address, an unresolvable name, a one-element list, a unix socket and host:port
    all go to the plain single-server path unchanged."""
    one = replicas_of("dns:///one:50051", resolver=_resolver("10.0.0.7"))
    assert one == ReplicaAddresses(("dns:///one:50051",))

    def fails(*_: Any, **__: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    assert replicas_of("dns:///later:50051", resolver=fails) == ReplicaAddresses(
        ("dns:///later:50051",)
    )
    assert replicas_of(["h1:50051"]) == ReplicaAddresses(("h1:50051",))
    unix = "unix:///run/batchd/batchd.sock"
    assert replicas_of(unix) == ReplicaAddresses((unix,))
    assert replicas_of("  h1:50051 ") == ReplicaAddresses(("h1:50051",))


def test_a_list_of_replicas_is_striped_and_mistakes_are_refused_by_name() -> None:
    """Two or more addresses stripe; an empty list, a repeated address, a non-string, a
    dns: target without a port or naming a DNS server are refused with what to write."""
    assert replicas_of(["h1:1", "h2:1", "unix:///s.sock"]) == ReplicaAddresses(
        ("h1:1", "h2:1", "unix:///s.sock")
    )
    with pytest.raises(InvalidArgument, match="list of addresses"):
        replicas_of([])
    with pytest.raises(InvalidArgument, match=r"\['h1:1'\] more than once"):
        replicas_of(["h1:1", "h2:1", "h1:1"])
    with pytest.raises(InvalidArgument, match="list of addresses"):
        replicas_of(["h1:1", 5])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="dns:///NAME:PORT"):
        replicas_of("dns:///pool", resolver=_resolver("1.2.3.4", "1.2.3.5"))
    with pytest.raises(InvalidArgument, match=r"names a DNS server \(8\.8\.8\.8\)"):
        replicas_of("dns://8.8.8.8/pool:50051", resolver=_resolver("1.2.3.4", "1.2.3.5"))


def test_resolving_again_adds_new_replicas_and_forgets_vanished_dropped_ones() -> None:
    """A pool that scaled out is striped over from then on; an address the name no longer
    has is forgotten once it is not live (a live one stays until it fails)."""
    answers = [("10.0.0.1", "10.0.0.2")]
    replicas = Replicas(
        replicas_of("dns:///pool:1", resolver=_resolver(*answers[0])),
        ChannelSecurity(),
        LoaderOptions(dataset="d", batch_size=1, rank=0, world_size=1),
        {"device": "cpu"},
        resolver=lambda *a, **k: _resolver(*answers[-1])(*a, **k),
    )
    try:
        replicas._live = [replicas._replicas[0]]  # 10.0.0.2 is not live
        answers.append(("10.0.0.1", "10.0.0.3"))
        replicas._resolve_again()
        assert [r.conn.target for r in replicas._replicas] == ["10.0.0.1:1", "10.0.0.3:1"]
        answers.append(("10.0.0.3",))
        replicas._resolve_again()
        assert [r.conn.target for r in replicas._replicas] == ["10.0.0.1:1", "10.0.0.3:1"]
    finally:
        replicas.close()
