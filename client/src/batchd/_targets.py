"""Where a client's server is: the target given (or ``$BATCHD_TARGET``), and the replicas a
Loader stripes over (a list, or every address of a ``dns:///`` name).

A target naming one server stays the string it was, for gRPC to resolve and connect to; a
Loader on it has one replica. Two or more replicas each get a channel of their own, by
address, so each serves its share of the epoch (see ``batchd._replicas``).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from batchd.errors import InvalidArgument

__all__ = [
    "TARGET_ENV",
    "ReplicaAddresses",
    "Resolver",
    "addresses_of",
    "replicas_of",
    "resolve_target",
]

logger = logging.getLogger(__name__)

TARGET_ENV: Final = "BATCHD_TARGET"

Resolver = Callable[..., list[tuple[Any, ...]]]
"""``socket.getaddrinfo``, or a stand-in for it."""


@dataclass(frozen=True)
class ReplicaAddresses:
    """The servers one Loader stripes over: addresses, and the DNS name they came from."""

    addresses: tuple[str, ...]
    """One target (a Loader on one server), or two or more replicas."""
    dns_host: str | None = None
    """The name a ``dns:///`` target resolved to several addresses (resolved again later;
    checked by TLS)."""
    dns_port: int = 0


def resolve_target(target: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The server address to use: ``target`` if given, else ``$BATCHD_TARGET``.

    Raises:
        InvalidArgument: neither is set.
    """
    env = os.environ if environ is None else environ
    resolved = target if target is not None else env.get(TARGET_ENV, "")
    if not resolved.strip():
        raise InvalidArgument(
            "no batchd server address: pass target= (for example 'unix:///run/batchd/grpc.sock' "
            f"or 'localhost:50051') or set {TARGET_ENV}"
        )
    return resolved.strip()


def replicas_of(
    target: str | Sequence[str] | None, resolver: Resolver = socket.getaddrinfo
) -> ReplicaAddresses:
    """The servers a Loader on ``target`` uses: one (the target string unchanged), or the
    replicas to stripe over: a list of two or more targets, or a ``dns:///NAME:PORT`` target
    whose name resolves to two or more addresses (A and AAAA records). A name that resolves
    to one address, or to none yet, stays one target for gRPC's own resolver.

    Raises:
        InvalidArgument: no target, an empty list, a target listed twice, a ``dns:`` target
            without a port or naming a DNS server (``dns://SERVER/...``).
    """
    if target is None or isinstance(target, str):
        single = resolve_target(target)
        if not single.startswith("dns:"):
            return ReplicaAddresses((single,))
        rest = single.removeprefix("dns:")
        if rest.startswith("//"):
            authority, _, rest = rest[2:].partition("/")
            if authority:
                raise InvalidArgument(
                    f"target={single!r} names a DNS server ({authority}); batchd resolves with "
                    "this machine's resolver: use dns:///NAME:PORT"
                )
        host, port = _split_host_port(rest, single)
        try:
            addresses = addresses_of(host, port, resolver)
        except OSError as e:
            logger.info("batchd: %s does not resolve yet (%s); one target for gRPC", host, e)
            return ReplicaAddresses((single,))
        if len(addresses) < 2:
            return ReplicaAddresses((single,))
        return ReplicaAddresses(tuple(addresses), host, port)
    targets = [resolve_target(t) if isinstance(t, str) else t for t in target]
    bad = [t for t in targets if not isinstance(t, str)]
    if not targets or bad:
        raise InvalidArgument(
            f"target={list(target)!r}: give one address, or a list of addresses to stripe over"
        )
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise InvalidArgument(f"target lists {twice} more than once; list each replica once")
    return ReplicaAddresses(tuple(targets))


def addresses_of(host: str, port: int, resolver: Resolver = socket.getaddrinfo) -> list[str]:
    """Every address ``host`` resolves to, as ``ip:port`` (IPv6 in brackets), in order.

    Raises:
        OSError: the name does not resolve.
    """
    found: list[str] = []
    for family, _, _, _, sockaddr in resolver(host, port, type=socket.SOCK_STREAM):
        ip = str(sockaddr[0])
        address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if address not in found:
            found.append(address)
    return found


def _split_host_port(where: str, target: str) -> tuple[str, int]:
    host, sep, port = where.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        # gRPC's default port is 443 for dns: targets; a loader pool never listens there.
        raise InvalidArgument(f"target={target!r}: give the name and the port, dns:///NAME:PORT")
    return host, int(port)
