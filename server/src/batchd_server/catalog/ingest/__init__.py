"""Filling the catalog: each kind of ingest is one module here, over one staged load.

``load`` is the load every kind goes through (the dataset row, the rows staged in chunks
and moved into ``samples`` in one transaction, the report); ``manifest``, ``imagefolder``,
``tar``, ``parquet``, ``jsonl`` (text documents) and ``mediafolder`` (video and audio
trees) each list their files and turn them into rows. A new kind of dataset is one more
module that hands :func:`~batchd_server.catalog.ingest.load.load` a
:class:`~batchd_server.catalog.ingest.load.Source`.
"""

from __future__ import annotations

from batchd_server.catalog.ingest.imagefolder import ingest_imagefolder
from batchd_server.catalog.ingest.jsonl import ingest_jsonl
from batchd_server.catalog.ingest.load import IngestReport
from batchd_server.catalog.ingest.manifest import ingest_manifest
from batchd_server.catalog.ingest.mediafolder import ingest_audiofolder, ingest_videofolder
from batchd_server.catalog.ingest.parquet import ingest_parquet
from batchd_server.catalog.ingest.tar import ingest_tar

__all__ = [
    "IngestReport",
    "ingest_audiofolder",
    "ingest_imagefolder",
    "ingest_jsonl",
    "ingest_manifest",
    "ingest_parquet",
    "ingest_tar",
    "ingest_videofolder",
]
