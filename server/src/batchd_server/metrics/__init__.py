"""Every Prometheus metric the server exports, in base units, one module per subject.

- ``registry``: the one registry they are all in, the histograms' buckets and the caps on
  label values (why no label names a session, a rank or a sample);
- ``admission``: readiness, open sessions and streams, refusals, shared memory;
- ``delivery``: catalog loads, first batches, batches, samples and bytes delivered, sample
  errors, batches shared within a share group;
- ``mixing``: a mix's samples and tokens per source beside what its weights expected;
- ``stall``: the clients' wait and step per batch and the data-stall ratio;
- ``workers``: the decode workers and where their time on each batch went;
- ``scaling``: the worker autoscaler;
- ``decode_cache`` and ``node_cache``: the two caches;
- ``endpoint``: ``/metrics`` over HTTP.

They take plain values (a dataset's name, counts, seconds), or a record of them whose fields
they describe as a Protocol; never a task or a result of the rooms that record them (those
are taken apart where they are observed, ``assembly.py``), so this package imports nothing
of the server but itself and stands on a low floor.
"""

from __future__ import annotations

from batchd_server.metrics.registry import REGISTRY

__all__ = ["REGISTRY"]
