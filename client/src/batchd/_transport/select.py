"""How batch bytes reach the client, chosen once per session: one table, one interface.

``shm`` (:mod:`.shm`): the client maps the server's ring segment and reads each batch in
place; news of batches and acks travel on the session's doorbell socket (:mod:`.doorbell`),
no gRPC at all. ``inline`` (:mod:`.inline`): the bytes travel in
``StreamBatchesResponse.data``. Each is a :class:`Transport` whose streams implement
``batchd._transport.stream.BatchStream``. ``auto`` takes shm when this process can open the
server's segment and reach its doorbell (same host, same ``/dev/shm``), else inline. A new
transport is one more implementation and one more row of :data:`_CHOICES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from batchd._proto.batchd.v1 import loader_pb2, loader_pb2_grpc
from batchd._transport.doorbell import ClientDoorbell, DoorbellRefused
from batchd._transport.inline import InlineTransport
from batchd._transport.shm import SHM_DIR, ShmRing, ShmTransport, ShmUnusable
from batchd._transport.stream import BatchStream, HeldSlots
from batchd.errors import FailedPrecondition

__all__ = ["Transport", "select_transport"]

_SHM_REMEDY: Final = (
    "run the trainer where it shares /dev/shm with the server (Kubernetes: the same pod with "
    "an emptyDir of medium Memory mounted at /dev/shm in both containers; docker: "
    "--ipc=container:<server> or one shared /dev/shm volume), or pass transport='auto' or "
    "'inline'"
)


class Transport(Protocol):
    """How one session's batches travel, chosen when it opens: it starts each of the
    session's streams and frees what it holds when the session closes."""

    @property
    def name(self) -> str:
        """``"shm"`` or ``"inline"``, as ``Loader.transport`` says."""
        ...

    @property
    def kind(self) -> loader_pb2.Transport:
        """What ``StreamStart.transport`` says."""
        ...

    @property
    def reason(self) -> str:
        """Why it was chosen, for the log."""
        ...

    @property
    def ring(self) -> ShmRing | None:
        """The mapped ring whose slots a delivery reads in place; None when batches arrive
        as buffers of their own."""
        ...

    def open_stream(
        self, start: loader_pb2.StreamStart, *, held: HeldSlots, timeout_s: float
    ) -> BatchStream:
        """Start the stream ``start`` describes (this transport fills in its own fields);
        ``held`` is the session's delivery, ``timeout_s`` bounds the server's accepting it.

        Raises:
            BatchdError: the server refused the stream (NotFound when the session is gone),
                or (shm) did not accept it in time.
        """
        ...

    def close(self) -> None:
        """Free what the transport holds (a mapping, a socket). Idempotent."""
        ...


@dataclass(frozen=True)
class _Offer:
    """What a session's transport is chosen from: the server's answer and the channel."""

    session: loader_pb2.OpenSessionResponse
    stub: loader_pb2_grpc.LoaderStub
    target: str
    shm_dir: Path

    def inline(self, reason: str) -> Transport:
        slot_bytes = self.session.ring.slot_bytes
        return InlineTransport(
            self.stub, target=self.target, max_batch_bytes=slot_bytes or None, reason=reason
        )

    def shm(self) -> Transport:
        """The server's ring mapped here, its doorbell connected.

        Raises:
            ShmUnusable: either cannot be used from here.
        """
        layout = self.session.ring
        ring = ShmRing.open(layout, self.shm_dir)
        try:
            ring.doorbell = _connect_doorbell(layout, self.session.session_id, self.shm_dir)
        except BaseException:
            ring.close()
            raise
        return ShmTransport(ring, "the server's segment is mapped")


def _inline_asked(offer: _Offer) -> Transport:
    return offer.inline("transport='inline' was asked for")


def _shm_asked(offer: _Offer) -> Transport:
    try:
        return offer.shm()
    except ShmUnusable as e:
        raise FailedPrecondition(
            f"transport='shm' cannot be used: {e}. To fix it, {_SHM_REMEDY}"
        ) from e


def _shm_where_usable(offer: _Offer) -> Transport:
    try:
        return offer.shm()
    except ShmUnusable as e:
        return offer.inline(f"shm unusable ({e})")


_CHOICES: Final[Mapping[str, Callable[[_Offer], Transport]]] = {
    "auto": _shm_where_usable,
    "shm": _shm_asked,
    "inline": _inline_asked,
}
"""``Loader(transport=...)`` → how that choice is made (its keys are
``batchd._wire.specs.TRANSPORTS``, which the Loader's options are checked against)."""


def select_transport(
    requested: str,
    session: loader_pb2.OpenSessionResponse,
    *,
    stub: loader_pb2_grpc.LoaderStub,
    target: str,
    shm_dir: Path = SHM_DIR,
) -> Transport:
    """The transport to use for a session.

    Args:
        requested: ``"auto"``, ``"shm"`` or ``"inline"``.
        session: The server's answer to OpenSession (its ring and doorbell).
        stub: The Loader stub of the session's channel (inline streams are calls on it).
        target: The server's address, for error messages.
        shm_dir: Where the server's segments are.

    Raises:
        FailedPrecondition: ``"shm"`` was asked for and the segment cannot be used.
    """
    return _CHOICES[requested](_Offer(session, stub, target, shm_dir))


def _connect_doorbell(
    layout: loader_pb2.RingLayout, session_id: str, shm_dir: Path
) -> ClientDoorbell:
    name = layout.doorbell
    if not name or "/" in name or name in (".", ".."):
        raise ShmUnusable(f"the server named no usable doorbell ({name!r})")
    try:
        return ClientDoorbell.connect(shm_dir / name, session_id, layout.token)
    except DoorbellRefused as e:
        raise ShmUnusable(str(e)) from e
