"""What the client and the server must agree on, in one room.

Both distributions import this package: the server (``batchd_server``) enters the client
distribution only through here, :mod:`batchd._proto` (the generated messages) and
:mod:`batchd.errors`. Nothing in it imports grpc, the Loader or torch, so a decode worker
that reads the ring layout stays a small process.

- :mod:`.ring` — the byte layout of a ring segment and of an inline batch.
- :mod:`.frames` — the doorbell protocol: frame kinds, encoder, reader, writer, deadlines.
- :mod:`.epoch` — how many batches the rest of an epoch has.
- :mod:`.status` — status code names to ``batchd.errors`` classes and back.
- :mod:`.metadata` — the gRPC metadata keys.
- :mod:`.specs`, :mod:`.mix` — the limits, defaults and choices both sides check.
- :mod:`.pack` — sequence packing's methods and limits.
- :mod:`.schedule` — a mix's weights by global step, and which step a batch is.
- :mod:`.lifetime` — ``with obj:`` for every object that holds something to close.
- :mod:`.tls` — whether a TCP target speaks TLS, to explain a failed connection.
"""
