"""The node cache's policy, driven by the live sessions' plans: which blocks to fetch ahead
of each stream and which to evict (Belady's rule, since each session's reads are known).

It sits above ``storage/`` (the cache's files and the fetchers that fill them) and
``planning/`` (the epoch plans it reads ahead of): storage keeps the bytes and knows nothing
of plans; this room decides what they should be.

- ``plan_blocks``: which blocks a session's plan reads, and when;
- ``eviction``: what leaves the cache first;
- ``manager``: the thread of the main process that does both (NOTE [ Cache manager ]).
"""
