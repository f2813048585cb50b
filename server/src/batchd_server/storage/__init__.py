"""Where dataset bytes live: local directories and S3-compatible object stores.

``base`` is the seam between the object-store client (``s3``) and the node-local cache
(``cache``): the cache wraps any :class:`~batchd_server.storage.base.RangeFetcher`.
"""
