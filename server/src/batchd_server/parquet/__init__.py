"""Parquet files as datasets: one row, one sample.

``payload`` finds a payload column in a file's schema and says what its values are and
which bytes of a row group hold them; ``samples`` turns files into catalog rows at ingest;
``rows`` is the worker's side, reading a row group's payloads once and serving its rows.
Every byte is read through the source's ``storage.reader.SampleReader`` (``read(path,
offset, length)``, ``size(path)``), so a root in an object store reads like a local one.
"""
