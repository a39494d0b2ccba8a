"""Prefix-cache index: which replica holds which KV blocks in which tier, fed by KV events.

The router asks :meth:`~kvstore.index_contract.PrefixIndex.match_tiers` with a request's block
hashes and gets, per live replica, the tier (medium, :mod:`kvstore.events`) of each leading
block of the request it holds (its pool or its host tier), and how many leading blocks the
shared Redis tier holds (any replica can load those);
:meth:`~kvstore.index_contract.PrefixIndex.match` gives just each replica's count. Each
replica's :class:`kvstore.publisher.KVEventPublisher` keeps the index current with its KV
events. Two implementations of one contract:

- :class:`~kvstore.index_memory.MemoryIndex`: dicts in this process (the embedded default when
  no Redis URL is given; thread-safe).
- :class:`~kvstore.index_redis.RedisIndex`: shared by every scheduler of a deployment through
  one Redis (standalone, or one shard: the scripts derive key names from the prefix).

Consistency (both): each replica numbers its batches of events 1, 2, ...; ``apply`` takes a
batch only if its number is the next one expected, otherwise it changes nothing and returns
False, and the replica then ``resync``s (replaces its entries by a snapshot of its cache).
A replica is live while its heartbeat has not expired; ``match`` drops every entry of a
known replica whose heartbeat is missing or expired (so heartbeat *before* the first
apply/resync, as the publisher does). Blocks of the shared Redis tier belong to no replica:
a ``BlockStored`` of medium ``redis`` records the block for its ``ttl`` (the Redis tier's TTL,
which the index cannot observe otherwise), whichever replica sent it, and a resync or a
dropped replica leaves them (a ``BlockRemoved`` of medium ``redis`` drops them). See
docs/kvstore.md.

The contract (:class:`~kvstore.index_contract.PrefixIndex`,
:class:`~kvstore.index_contract.PrefixMatch`, :class:`~kvstore.index_contract.IndexUnavailable`)
is in :mod:`kvstore.index_contract`, the implementations in :mod:`kvstore.index_memory` and
:mod:`kvstore.index_redis` (with its Redis key schema); callers import them from there. This
module picks one: :func:`open_index`.
"""

from __future__ import annotations

from kvstore.index_contract import PrefixIndex
from kvstore.index_memory import MemoryIndex
from kvstore.index_redis import RedisIndex

__all__ = ["open_index"]


def open_index(url: str | None = None, prefix: str = "kvmesh", timeout: float = 0.005) -> PrefixIndex:
    """A :class:`~kvstore.index_redis.RedisIndex` on ``url`` (``redis://host:port/db``; ``prefix``
    starts its keys, ``timeout`` in seconds bounds each call), or a
    :class:`~kvstore.index_memory.MemoryIndex` when ``url`` is empty or None. Connects lazily:
    never raises IndexUnavailable."""
    return RedisIndex(url, prefix=prefix, timeout=timeout) if url else MemoryIndex()
