"""How many bytes a row group's payload may take once decoded, known before it is decoded.

A column chunk's bytes say little of what they decode to: a ZSTD page of a few KiB can hold
a GiB of zeros, a page of run-length nulls can claim billions of values in a few bytes, and a
dictionary-encoded binary column repeats one large value in every row for four bytes a row.
So before a worker decodes a row group's payload it bounds what the decode allocates, from
what the file says, in two steps:

1. :func:`footer_bound`, from the footer alone, before the chunk is read: its pages'
   uncompressed bytes (``total_uncompressed_size``) and its values.
2. :func:`pages_bound`, from the chunk's page headers (walked by the bounded reader of
   ``pages.py``; the values are not read), which is what pyarrow's reader allocates by:
   each page's uncompressed size and values, and for a binary column each dictionary-encoded
   value as large as its dictionary page at most.

Either bound over the worker's budget (``--max-sample-bytes``) makes the row group's rows
``too_large``; page headers that do not parse, or that do not add up to the footer's values,
make them ``corrupt``. A bound that is over the budget only through the dictionary's
repetition is measured exactly instead (``rows.py`` decodes the dictionary and its indices,
not the values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import pyarrow.parquet as pq

from batchd_server.parquet.pages import NotPlain, Read, chunk_pages
from batchd_server.parquet.payload import Payload
from batchd_server.pipelines.base import BadSample

__all__ = ["PER_VALUE_BYTES", "Bound", "footer_bound", "pages_bound"]

PER_VALUE_BYTES: Final = 16
"""What a decoded value costs beyond its bytes: an offset, a definition and a repetition
level, a validity bit (a null costs this too)."""
_DATA_PAGES: Final = (0, 3)
_DICTIONARY_PAGE: Final = 2
_DICTIONARY_ENCODINGS: Final = (2, 8)  # PLAIN_DICTIONARY, RLE_DICTIONARY


@dataclass(frozen=True)
class Bound:
    """At most ``plain + repeated`` bytes: ``repeated`` is what dictionary-encoded binary
    values may add by repeating dictionary entries (0 for numbers: a number's size is
    known)."""

    plain: int
    repeated: int = 0


def footer_bound(metadata: pq.FileMetaData, leaves: tuple[int, ...], row_group: int) -> int:
    """What the footer says the payload's pages of ``row_group`` hold, uncompressed, with
    their values' overhead: a floor of the decoded size, known before reading the chunk."""
    group = metadata.row_group(row_group)
    total = 0
    for leaf in leaves:
        column = group.column(leaf)
        total += max(0, column.total_uncompressed_size) + PER_VALUE_BYTES * max(
            0, column.num_values
        )
    return total


def pages_bound(
    metadata: pq.FileMetaData, payload: Payload, row_group: int, read: Read, where: str
) -> Bound:
    """What decoding the payload of ``row_group`` can allocate at most, from its page headers
    (``read``: the file's bytes, the chunk's at least; ``where`` names the row group in
    messages).

    Raises:
        BadSample: ``corrupt``, page headers that do not parse or whose values are not the
            footer's.
    """
    group = metadata.row_group(row_group)
    plain = repeated = 0
    for leaf in payload.leaves:
        column = group.column(leaf)
        start = column.data_page_offset
        dictionary = column.dictionary_page_offset
        if column.has_dictionary_page and dictionary is not None and 0 < dictionary < start:
            start = dictionary
        values = 0
        dictionary_bytes = 0
        try:
            for header, _ in chunk_pages(read, start, column.total_compressed_size):
                plain += header.uncompressed
                if header.kind == _DICTIONARY_PAGE:
                    dictionary_bytes = header.uncompressed
                elif header.kind in _DATA_PAGES:
                    values += header.values
                    if payload.kind == "binary" and header.encoding in _DICTIONARY_ENCODINGS:
                        repeated += header.values * dictionary_bytes
        except NotPlain as e:
            raise BadSample("corrupt", f"{where}: its pages cannot be read ({e})") from e
        if values != column.num_values:
            raise BadSample(
                "corrupt",
                f"{where}: its pages hold {values} values, its footer says {column.num_values}",
            )
        plain += PER_VALUE_BYTES * values
    return Bound(plain, repeated)
