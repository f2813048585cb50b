"""How batch bytes reach the client, chosen once per session.

``shm`` (``_shm.py``): the client maps the server's ring segment and reads each batch in
place; news of batches and acks travel on the session's doorbell socket, no gRPC at all.
``inline`` (``_inline.py``): the bytes travel in ``StreamBatchesResponse.data``. Both
streams implement ``batchd._stream.BatchStream``. ``auto`` takes shm when this process can
open the server's segment and reach its doorbell (same host, same ``/dev/shm``), else
inline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from batchd._doorbell import ClientDoorbell, DoorbellRefused
from batchd._proto.batchd.v1 import loader_pb2
from batchd._shm import SHM_DIR, ShmRing, ShmUnusable
from batchd.errors import FailedPrecondition

__all__ = ["select_transport"]

_SHM_REMEDY: Final = (
    "run the trainer where it shares /dev/shm with the server (Kubernetes: the same pod with "
    "an emptyDir of medium Memory mounted at /dev/shm in both containers; docker: "
    "--ipc=container:<server> or one shared /dev/shm volume), or pass transport='auto' or "
    "'inline'"
)


def select_transport(
    requested: str, session: loader_pb2.OpenSessionResponse, shm_dir: Path = SHM_DIR
) -> tuple[loader_pb2.Transport, ShmRing | None, str]:
    """The transport to use for a session, its mapped ring (shm) and why it was chosen.

    Args:
        requested: ``"auto"``, ``"shm"`` or ``"inline"``.
        session: The server's answer to OpenSession (its ring and doorbell).
        shm_dir: Where the server's segments are.

    Raises:
        FailedPrecondition: ``"shm"`` was asked for and the segment cannot be used.
    """
    if requested == "inline":
        return loader_pb2.TRANSPORT_INLINE, None, "transport='inline' was asked for"
    layout = session.ring
    try:
        ring = ShmRing.open(layout, shm_dir)
        try:
            ring.doorbell = _connect_doorbell(layout, session.session_id, shm_dir)
        except BaseException:
            ring.close()
            raise
    except ShmUnusable as e:
        if requested == "shm":
            raise FailedPrecondition(
                f"transport='shm' cannot be used: {e}. To fix it, {_SHM_REMEDY}"
            ) from e
        return loader_pb2.TRANSPORT_INLINE, None, f"shm unusable ({e})"
    return loader_pb2.TRANSPORT_SHM, ring, "the server's segment is mapped"


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
