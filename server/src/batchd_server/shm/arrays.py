"""Named numpy arrays packed into one shared-memory segment, mapped read-only by workers.

The catalog's ``SplitArrays`` columns reach the worker processes this way: the server packs
them once per loaded split and each worker maps the segment read-only, so nothing is pickled
and no copy-on-write page is ever duplicated.

Layout of a pack (all integers little-endian)::

    0   magic            8 bytes, b"BATCHDA1"
    8   header_bytes     uint64, length of the JSON header
    16  header           UTF-8 JSON: {"arrays": {name: [dtype.str, shape, offset], ...}}
    D   data             D = 16 + header_bytes rounded up to ALIGN_BYTES;
                         each array C-contiguous at D + offset, offset a multiple of ALIGN_BYTES

Offsets count from ``D`` so that the header's length does not depend on them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from batchd._wire.ring import round_up
from batchd_server.errors import InvalidArgument
from batchd_server.shm.registry import ShmRegistry
from batchd_server.shm.segments import SHM_DIR, Attachment, Segment, attach

__all__ = ["ALIGN_BYTES", "MAGIC", "attach_arrays", "pack_arrays"]

MAGIC: Final = b"BATCHDA1"
ALIGN_BYTES: Final = 64
"""Alignment of every array: a cache line, and enough for any SIMD load numpy makes."""

_PREFIX: Final = struct.Struct("<8sQ")


def pack_arrays(
    registry: ShmRegistry, arrays: Mapping[str, npt.ArrayLike], *, purpose: str
) -> Segment:
    """Copy ``arrays`` into a new ``"catalog"`` segment of ``registry``.

    Args:
        registry: Creates (and later releases) the segment.
        arrays: Name to array. Any shape, including empty and 0-d; any dtype except object
            and structured dtypes (their ``dtype.str`` cannot describe them).
        purpose: For error messages, e.g. ``"catalog of imagenet/train"``.

    Raises:
        InvalidArgument: A name is not a string or a dtype cannot be packed.
        ResourceExhausted: See ``ShmRegistry.create``.
    """
    prepared = {name: _packable(name, array) for name, array in arrays.items()}
    layout: dict[str, list[Any]] = {}
    data_bytes = 0
    for name, array in prepared.items():
        layout[name] = [array.dtype.str, list(array.shape), data_bytes]
        data_bytes = _align(data_bytes + array.nbytes)
    header = json.dumps({"arrays": layout}, separators=(",", ":")).encode("utf-8")
    data_start = _align(_PREFIX.size + len(header))
    segment = registry.create("catalog", data_start + data_bytes, purpose=purpose)
    try:
        segment.buf[: _PREFIX.size] = _PREFIX.pack(MAGIC, len(header))
        segment.buf[_PREFIX.size : _PREFIX.size + len(header)] = header
        for name, array in prepared.items():
            offset = data_start + layout[name][2]
            segment.ndarray(array.dtype, array.shape, offset)[...] = array
    except BaseException:
        registry.release(segment)
        raise
    return segment


def attach_arrays(
    name: str, *, shm_dir: Path = SHM_DIR
) -> tuple[dict[str, npt.NDArray[Any]], Attachment]:
    """Map a segment written by ``pack_arrays`` read-only and view its arrays.

    The arrays are read-only views of the mapping (``writeable`` is False and cannot be set).
    The caller keeps the ``Attachment`` and closes it when done; closing while arrays are still
    alive is safe, they keep the mapping until they die.

    Raises:
        NotFound: No such segment.
        InvalidArgument: ``name`` is not a pack of arrays, or its header is damaged.
    """
    attachment = attach(name, writable=False, shm_dir=shm_dir)
    try:
        return _read(attachment), attachment
    except BaseException:
        attachment.close()
        raise


def _read(attachment: Attachment) -> dict[str, npt.NDArray[Any]]:
    name = attachment.name
    if attachment.nbytes < _PREFIX.size:
        raise InvalidArgument(f"segment {name} ({attachment.nbytes} bytes) is not an array pack")
    magic, header_bytes = _PREFIX.unpack_from(attachment.buf)
    if magic != MAGIC or _PREFIX.size + header_bytes > attachment.nbytes:
        raise InvalidArgument(
            f"segment {name} is not an array pack written by pack_arrays (magic {magic!r}, "
            f"header of {header_bytes} bytes in a segment of {attachment.nbytes})"
        )
    data_start = _align(_PREFIX.size + header_bytes)
    try:
        header = json.loads(attachment.buf[_PREFIX.size : _PREFIX.size + header_bytes])
        arrays = {
            str(key): attachment.ndarray(np.dtype(dtype), tuple(shape), data_start + int(offset))
            for key, (dtype, shape, offset) in header["arrays"].items()
        }
    except (ValueError, TypeError, KeyError) as e:
        # InvalidArgument from ndarray() is a ValueError too: an array beyond the end.
        raise InvalidArgument(f"array pack {name} has a damaged header: {e}") from e
    for array in arrays.values():
        array.setflags(write=False)  # already so when mapped read-only; also for writable maps
    return arrays


def _packable(name: object, array: npt.ArrayLike) -> npt.NDArray[Any]:
    if not isinstance(name, str):
        raise InvalidArgument(f"array names must be strings, not {name!r}")
    packed = np.asarray(array)
    if packed.dtype.hasobject or packed.dtype.fields is not None:
        raise InvalidArgument(
            f"array {name!r} has dtype {packed.dtype}, which cannot live in shared memory; "
            "use plain numeric, bool, bytes (S) or unicode (U) arrays, one per column"
        )
    return packed


def _align(n: int) -> int:
    return round_up(n, ALIGN_BYTES)
