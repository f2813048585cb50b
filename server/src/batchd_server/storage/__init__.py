"""Where dataset bytes live: local directories and object stores (S3 and S3-compatible,
Google Cloud Storage, Azure Blob: one row each in ``clouds``).

``reader`` is the seam every sample byte comes through (``SampleReader``): ``files`` reads a
local root, ``objects`` a store's prefix, and ``open`` picks one by the root's scheme.

``base`` is the seam between the object-store client (``s3``, for every store) and the
node-local cache (``cache``): the cache wraps any :class:`~batchd_server.storage.base.RangeFetcher`.
"""
