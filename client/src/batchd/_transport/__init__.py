"""How batch bytes travel from the server to the Loader: the client's transport room.

- :mod:`.select` — the :class:`~.select.Transport` interface and the one table that picks
  a session's transport (``auto``, ``shm``, ``inline``).
- :mod:`.stream` — :class:`~.stream.BatchStream`, what one pass over an epoch looks like to
  the Loader whatever carries the bytes, and :class:`~.stream.ReceivedBatch`.
- :mod:`.shm` — the ``shm`` transport: the server's ring segment mapped here, read in place.
- :mod:`.doorbell` — the shm transport's socket: news of batches in, acks out.
- :mod:`.inline` — the ``inline`` transport: batch bytes inside one gRPC call per stream.

The Loader's epoch loop and its connections see only ``Transport`` and ``BatchStream``; the
protocol both sides speak (ring layout, doorbell frames) is :mod:`batchd._wire`.
"""
