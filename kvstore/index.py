"""Prefix-cache index: which replica holds which KV blocks in which tier, fed by KV events.

The router asks :meth:`PrefixIndex.match_tiers` with a request's block hashes and gets, per
live replica, the tier (medium, :mod:`kvstore.events`) of each leading block of the request
it holds (its pool or its host tier), and how many leading blocks the shared Redis tier holds
(any replica can load those); :meth:`PrefixIndex.match` gives just each replica's count.
Each replica's :class:`kvstore.publisher.KVEventPublisher` keeps the index current with its
KV events. Two implementations of one contract:

- :class:`MemoryIndex`: dicts in this process (the embedded default when no Redis URL is
  given; thread-safe).
- :class:`RedisIndex`: shared by every scheduler of a deployment through one Redis
  (standalone, or one shard: the scripts derive key names from the prefix).

Consistency (both): each replica numbers its batches of events 1, 2, ...; ``apply`` takes a
batch only if its number is the next one expected, otherwise it changes nothing and returns
False, and the replica then ``resync``s (replaces its entries by a snapshot of its cache).
A replica is live while its heartbeat has not expired; ``match`` drops every entry of a
known replica whose heartbeat is missing or expired (so heartbeat *before* the first
apply/resync, as the publisher does). Blocks of the shared Redis tier belong to no replica:
a ``BlockStored`` of medium ``redis`` records the block for its ``ttl`` (the Redis tier's TTL,
which the index cannot observe otherwise), whichever replica sent it, and a resync or a

The contract (:class:`PrefixIndex`, :class:`PrefixMatch`, :class:`IndexUnavailable`) is in
:mod:`kvstore.index_contract`, the implementations in :mod:`kvstore.index_memory` and
:mod:`kvstore.index_redis` (with its Redis key schema); this module is where callers import
them from, with :func:`open_index`.
"""

from __future__ import annotations

from kvstore.index_contract import (
    REPLICA_MEDIUMS,
    SHARED_NO_TTL,
    IndexUnavailable,
    PrefixIndex,
    PrefixMatch,
    Snapshot,
)
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex

__all__ = ["REPLICA_MEDIUMS", "SHARED_NO_TTL", "IndexUnavailable", "MemoryIndex", "PrefixIndex", "PrefixMatch",
           "RedisIndex", "Snapshot", "open_index"]


def open_index(url: str | None = None, prefix: str = "kvmesh", timeout: float = 0.005) -> PrefixIndex:
    """A :class:`RedisIndex` on ``url`` (``redis://host:port/db``), or a :class:`MemoryIndex`
    when ``url`` is empty or None. Connects lazily: never raises IndexUnavailable."""
    return RedisIndex(url, prefix=prefix, timeout=timeout) if url else MemoryIndex()
