"""KV cache tiers below a replica's KV pool: host memory and a shared Redis.

Two ways down, each suited to its tier (the engine copies a block's K/V out of the pool: every
layer of every pipeline stage, in the cache's own dtype, quantized blocks with their scales):

- host memory, on eviction: when the block manager evicts a cached block (or the pool's prefix
  cache is reset with ``offload``), the block goes to this replica's :class:`HostTier` (an LRU
  bounded in bytes). Nothing is copied while the pool still holds the block.
- Redis, write-through: when a block becomes cached (computed and full), it is also written to
  the :class:`RedisTier` (shared by every replica of a deployment, with a TTL) by a background
  thread, so that another replica can load it even while (or after) this one holds it: after a
  restart, or when the router moves the chat for load.
 At admission, the leading prompt blocks that miss the pool are looked up here, host first,
then Redis; the ones found are loaded into newly allocated pool blocks instead of being
recomputed. Anything wrong with a value (missing, corrupted, another format version or layout,
Redis down or slow) is a miss: the block is recomputed, never loaded wrong.

A block is stored as one value per pipeline stage (each stage holds its own layers), under a
key naming its block hash and layer range, in a checked format (:mod:`kvstore.tier_format`);
the stores are :mod:`kvstore.tier_stores`. This module composes them (:class:`KVTiers`);
callers import the format's and the stores' names from their own modules.

KV events (:mod:`kvstore.events`): the tiers queue ``BlockStored``/``BlockRemoved`` of medium
``host`` as blocks enter and leave the host tier (offload, promotion from Redis, LRU) and
``BlockStored`` of medium ``redis`` (with the TTL) once a write-through has reached Redis; the
engine forwards them with the pool's events (:meth:`KVTiers.take_events`). A value dropped by
Redis itself (TTL, ``maxmemory``) is not observed: the index keeps a Redis block for the TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.events import HOST, REDIS, BlockRemoved, BlockStored, KVEvent
from kvstore.tier_format import BlockLayout, TierValueError, block_hash_of, block_key, decode_value, encode_value
from kvstore.tier_stores import HostTier, RedisTier, TierUnavailable

__all__ = ["FetchedBlock", "KVTiers", "TierStats"]

log = logging.getLogger("kvmesh.kvstore")


@dataclass
class TierStats:
    """Counters of one replica's tiers (blocks, bytes, seconds), cumulative."""

    hits: dict[str, int] = field(default_factory=lambda: {HOST: 0, REDIS: 0})          # blocks loaded
    bytes_loaded: dict[str, int] = field(default_factory=lambda: {HOST: 0, REDIS: 0})
    bytes_stored: dict[str, int] = field(default_factory=lambda: {HOST: 0, REDIS: 0})  # redis: queued
    blocks_offloaded: int = 0
    lookup_seconds: float = 0.0       # looking up and checking values (the admission's share)
    load_seconds: float = 0.0         # copying them into the pool (the executor's share)
    integrity_failures: int = 0       # corrupted or truncated values (recomputed)
    format_mismatches: int = 0        # another format version or layout (recomputed)
    unavailable: int = 0              # look-ups that found Redis down or slow (recomputed)


@dataclass
class FetchedBlock:
    """One block found below the pool: the tier it came from and its bodies, one per stage."""

    tier: str
    bodies: list[bytes]


class KVTiers:
    """The tiers below one replica's pool (:data:`HOST` and/or :data:`REDIS`).

    Args:
        layout: the replica's block layout (one value per pipeline stage).
        host_bytes: capacity of the host tier in bytes (0 = no host tier).
        redis_url: the shared Redis tier (empty = none).
        prefix: key prefix (one per deployment; keys are ``{prefix}:kv:...``).
        ttl: seconds a Redis value lives.
        timeout: Redis connect/read timeout, seconds.
    """

    def __init__(self, layout: BlockLayout, host_bytes: int = 0, redis_url: str = "", prefix: str = "kvmesh",
                 ttl: float = 3600.0, timeout: float = 1.0):
        self.layout, self.prefix = layout, prefix
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.redis = (RedisTier(redis_url, ttl=ttl, timeout=timeout, encode=lambda s, b: encode_value(layout, s, b),
                                on_written=self._written) if redis_url else None)
        self.stats = TierStats()
        self._events: list[KVEvent] = []
        self._events_lock = threading.Lock()      # the Redis writer thread queues events too

    def keys(self, block_hash: int) -> list[str]:
        return [block_key(self.prefix, block_hash, r) for r in self.layout.layer_ranges]

    # ---- KV events ---------------------------------------------------------------------------
    def _queue_events(self, events: list[KVEvent]) -> None:
        with self._events_lock:
            self._events += events

    def take_events(self) -> list[KVEvent]:
        """The tiers' KV events since the last call, in order (module docstring)."""
        with self._events_lock:
            ev, self._events = self._events, []
        return ev

    def _written(self, block_hashes: tuple[int, ...]) -> None:
        """A write-through reached Redis (the writer thread)."""
        self._queue_events([BlockStored(block_hashes, None, self.layout.block_size, REDIS, self.redis.ttl)])

    def host_block_hashes(self) -> list[int]:
        """Hashes of the blocks the host tier holds whole (every stage's value): the ``host``
        part of a prefix-index resync."""
        if self.host is None:
            return []
        keys = self.host.keys()
        n_stages = len(self.layout.layer_ranges)
        count: dict[int, int] = {}
        for k in keys:
            h = block_hash_of(k)
            count[h] = count.get(h, 0) + 1
        return [h for h, n in count.items() if n == n_stages]

    def _host_put(self, blocks: list[tuple[int, list[tuple[str, bytes]]]]) -> int:
        """Put ``(block hash, [(key, value) per stage])`` into the host tier and queue the events
        of what it holds afterwards: ``BlockRemoved`` for the blocks its LRU dropped,
        ``BlockStored`` for the blocks now whole in it. Returns the bytes put."""
        n, dropped = 0, {}                                 # ordered: events in a stable order
        for _, values in blocks:
            for key, value in values:
                dropped.update(dict.fromkeys(block_hash_of(k) for k in self.host.put(key, value)))
                n += len(value)
        kept = list(dict.fromkeys(h for h, values in blocks if all(k in self.host for k, _ in values)))
        removed = tuple(h for h in dropped if h not in kept)
        events: list[KVEvent] = [BlockRemoved(removed, HOST)] if removed else []
        if kept:
            events.append(BlockStored(tuple(kept), None, self.layout.block_size, HOST))
        self._queue_events(events)
        return n

    # ---- down and up -------------------------------------------------------------------------
    def offload(self, block_hashes: Sequence[int], bodies: Sequence[Sequence[bytes]]) -> None:
        """Keep blocks evicted from the pool in the host tier: ``bodies[i][s]`` is stage ``s``'s
        body of block ``block_hashes[i]``. A no-op without a host tier."""
        if self.host is None:
            return
        blocks = [(h, [(key, encode_value(self.layout, s, body)) for s, (key, body) in enumerate(zip(self.keys(h), parts))])
                  for h, parts in zip(block_hashes, bodies)]
        self.stats.bytes_stored[HOST] += self._host_put(blocks)
        self.stats.blocks_offloaded += len(blocks)

    def publish(self, block_hashes: Sequence[int], bodies: Sequence[Sequence[bytes]]) -> None:
        """Write newly computed blocks to the Redis tier (write-through, in the background:
        another replica may need them even while this one still holds them). A no-op
        without a Redis tier; dropped (counted) when the writer is too far behind."""
        if self.redis is None or not block_hashes:
            return
        items = [(key, s, body) for h, parts in zip(block_hashes, bodies)
                 for s, (key, body) in enumerate(zip(self.keys(h), parts))]
        if self.redis.put_async(items, tag=tuple(block_hashes)):
            self.stats.bytes_stored[REDIS] += sum(len(b) for _, _, b in items)

    def fetch(self, block_hashes: Sequence[int]) -> list[FetchedBlock]:
        """The leading blocks of ``block_hashes`` that a tier holds intact (host first, then
        Redis), stopping at the first block that no tier holds, or holds damaged. Never raises:
        Redis being down or slow, a corrupted value or another format is a miss (counted).
        Hits are counted by :meth:`count_loaded`, once the blocks are used."""
        t0 = time.perf_counter()
        out: list[FetchedBlock] = []
        pending = list(block_hashes)
        if self.host is not None:
            for h in pending:
                parts = self._decode([self.host.get(k) for k in self.keys(h)], HOST)
                if parts is None:
                    break
                out.append(FetchedBlock(HOST, parts))
            pending = pending[len(out):]
        if self.redis is not None and pending:
            n_stages = len(self.layout.layer_ranges)
            promoted = []
            try:
                values = self.redis.get_many([k for h in pending for k in self.keys(h)])
            except TierUnavailable as e:
                self.stats.unavailable += 1
                log.warning("%s; recomputing", e)
                values = []
            for i, h in enumerate(pending):
                raw = values[i * n_stages:(i + 1) * n_stages]
                parts = self._decode(raw, REDIS) if len(raw) == n_stages else None
                if parts is None:
                    break
                out.append(FetchedBlock(REDIS, parts))
                promoted.append((h, list(zip(self.keys(h), raw))))
            if self.host is not None and promoted:   # promote: the next look-up stays local
                self._host_put(promoted)
        self.stats.lookup_seconds += time.perf_counter() - t0
        return out

    def count_loaded(self, blocks: Sequence[FetchedBlock]) -> None:
        """Count blocks that were loaded into the pool (hits and bytes per tier)."""
        for b in blocks:
            self.stats.hits[b.tier] += 1
            self.stats.bytes_loaded[b.tier] += sum(len(p) for p in b.bodies)

    def _decode(self, values: list[bytes | None], tier: str) -> list[bytes] | None:
        if any(v is None for v in values):
            return None
        try:
            return [decode_value(self.layout, s, v) for s, v in enumerate(values)]
        except TierValueError as e:
            if e.reason == "integrity":
                self.stats.integrity_failures += 1
            else:
                self.stats.format_mismatches += 1
            log.warning("kv tier %s: unusable value, recomputing: %s", tier, e)
            return None

    def writes_pending(self) -> bool:
        """Whether Redis writes are queued and not yet attempted."""
        return self.redis is not None and self.redis.pending_bytes > 0

    def flush(self) -> None:
        """Wait for queued Redis writes (tests, benchmarks)."""
        if self.redis is not None:
            self.redis.flush()

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
