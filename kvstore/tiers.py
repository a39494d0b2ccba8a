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

A block is stored as one value per pipeline stage (each stage holds its own layers). Key::

    {prefix}:kv:{block hash:016x}:{start layer}-{end layer}

The block hash is the prefix cache's chained hash (:mod:`kvstore.hashing`), whose seed already
covers the model, its weight format and the KV dtype; the layer range keeps pipeline layouts
apart. Keys carry no request text. Value (little-endian)::

    magic  b"KVMT"   4 bytes
    version          uint16   (FORMAT_VERSION)
    layout length    uint16   n
    body length      uint64
    checksum         uint64   xxh3_64 of the body
    layout           n bytes  UTF-8, e.g. "dtype=bfloat16;bs=16;kvh=3;d=64;layers=0-30;scales=0"
    body                      K/V data [layers, 2, block_size, kv_heads, head_dim] in the cache
                              dtype, then (quantized caches) scales [layers, 2, kv_heads] float32

The body layout is :func:`workers.kv_blocks.save_blocks`'s.

KV events (:mod:`kvstore.events`): the tiers queue ``BlockStored``/``BlockRemoved`` of medium
``host`` as blocks enter and leave the host tier (offload, promotion from Redis, LRU) and
``BlockStored`` of medium ``redis`` (with the TTL) once a write-through has reached Redis; the
engine forwards them with the pool's events (:meth:`KVTiers.take_events`). A value dropped by
Redis itself (TTL, ``maxmemory``) is not observed: the index keeps a Redis block for the TTL.

Why one file over ~450 lines: the value format, the two tiers and :class:`KVTiers`, which
composes them and names their keys and events, change together (a format version, a key, an
event medium).
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from kvstore.events import HOST, REDIS, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("kvmesh.kvstore")

FORMAT_VERSION = 1
MAGIC = b"KVMT"
_HEADER = struct.Struct("<4sHHQQ")


class TierValueError(ValueError):
    """A stored value is unusable. ``reason``: ``integrity`` (bad magic, truncated, checksum
    mismatch) or ``format`` (another format version or block layout)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class TierUnavailable(RuntimeError):
    """The Redis tier could not answer (down, refused, timed out)."""


@dataclass(frozen=True)
class BlockLayout:
    """What one block's K/V looks like in a replica's pool.

    Attributes:
        dtype: stored K/V dtype name (``bfloat16``, ``float32``, ``int8``, ``float8_e4m3fn``...).
        itemsize: bytes per stored value.
        block_size: tokens per block.
        num_kv_heads, head_dim: per layer.
        layer_ranges: ``[start, end)`` decoder layers of each pipeline stage, in order.
        quantized: the cache keeps float32 scales ``[2, kv_heads]`` per layer and block.
    """

    dtype: str
    itemsize: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    layer_ranges: tuple[tuple[int, int], ...]
    quantized: bool

    def body_bytes(self, stage: int) -> int:
        """Bytes of one block's body for pipeline stage ``stage`` (data, then scales)."""
        start, end = self.layer_ranges[stage]
        layers = end - start
        data = layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize
        return data + (layers * 2 * self.num_kv_heads * 4 if self.quantized else 0)

    def describe(self, stage: int) -> bytes:
        start, end = self.layer_ranges[stage]
        return (f"dtype={self.dtype};bs={self.block_size};kvh={self.num_kv_heads};d={self.head_dim};"
                f"layers={start}-{end};scales={int(self.quantized)}").encode()


def block_key(prefix: str, block_hash: int, layers: tuple[int, int]) -> str:
    """``{prefix}:kv:{hash:016x}:{start}-{end}``: the key of one stage's part of a block."""
    return f"{prefix}:kv:{block_hash:016x}:{layers[0]}-{layers[1]}"


def block_hash_of(key: str) -> int:
    """The block hash in a :func:`block_key` key."""
    return int(key.rsplit(":", 2)[1], 16)


def encode_value(layout: BlockLayout, stage: int, body: bytes) -> bytes:
    """Header + ``body`` (one stage's part of a block). Raises ValueError on a body of the
    wrong size."""
    if len(body) != layout.body_bytes(stage):
        raise ValueError(f"block body is {len(body)} bytes, the layout says {layout.body_bytes(stage)}")
    desc = layout.describe(stage)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, len(desc), len(body), xxhash.xxh3_64_intdigest(body))
    return head + desc + body


def decode_value(layout: BlockLayout, stage: int, value: bytes) -> bytes:
    """The body of a stored value, checked against ``layout`` and its checksum.
    Raises TierValueError (``integrity`` or ``format``)."""
    if len(value) < _HEADER.size:
        raise TierValueError("integrity", f"value of {len(value)} bytes is shorter than its header")
    magic, version, n_desc, n_body, checksum = _HEADER.unpack_from(value)
    if magic != MAGIC:
        raise TierValueError("integrity", f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise TierValueError("format", f"format version {version}, this replica reads {FORMAT_VERSION}")
    desc = bytes(value[_HEADER.size:_HEADER.size + n_desc])
    if desc != layout.describe(stage):
        raise TierValueError("format", f"block layout {desc!r}, this replica's is {layout.describe(stage)!r}")
    body = value[_HEADER.size + n_desc:]
    if len(body) != n_body or n_body != layout.body_bytes(stage):
        raise TierValueError("integrity", f"body of {len(body)} bytes, header says {n_body}")
    if xxhash.xxh3_64_intdigest(body) != checksum:
        raise TierValueError("integrity", "checksum mismatch")
    return bytes(body)


class HostTier:
    """Values in this process's memory, least recently used dropped first once their bytes
    exceed ``capacity`` (bytes; keys are not counted). Thread-safe."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def put(self, key: str, value: bytes) -> list[str]:
        """Store (or refresh) ``value``; a value larger than the capacity is not kept. Returns
        the keys dropped to make room (least recently used first)."""
        dropped: list[str] = []
        with self._lock:
            old = self._values.pop(key, None)
            if old is not None:
                self.bytes -= len(old)
            if len(value) > self.capacity:
                return dropped
            self._values[key] = value
            self.bytes += len(value)
            while self.bytes > self.capacity:
                k, v = self._values.popitem(last=False)
                self.bytes -= len(v)
                self.evictions += 1
                dropped.append(k)
        return dropped

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._values)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            v = self._values.get(key)
            if v is not None:
                self._values.move_to_end(key)
            return v

    def delete(self, key: str) -> None:
        with self._lock:
            v = self._values.pop(key, None)
            if v is not None:
                self.bytes -= len(v)


class RedisTier:
    """Values in a Redis shared by replicas, each written with a TTL. Writes go through a
    background thread (the engine loop never waits for them); a write queued while more than
    ``max_pending_bytes`` wait is dropped (counted in ``dropped``). Reads raise
    TierUnavailable when Redis is down or slower than ``timeout`` seconds.

    Args:
        url: ``redis://host:port/db``.
        ttl: seconds a value lives (0 = no expiry: bound Redis with ``maxmemory`` and an
            ``allkeys-lru`` policy).
        timeout: socket connect and read timeout, seconds.
        max_pending_bytes: bytes of writes that may wait for the writer thread.
        encode: ``(stage, body) -> value``, run on the writer thread for items queued as
            ``(key, stage, body)`` (None: items are ``(key, value)``).
        on_written: ``(tag) -> None``, called on the writer thread once a batch queued with a
            ``tag`` (not None) has been written.
    """

    def __init__(self, url: str, ttl: float = 3600.0, timeout: float = 1.0, max_pending_bytes: int = 256 * 2**20,
                 encode=None, on_written=None):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        self.url, self.ttl = url, ttl
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
                                            health_check_interval=0)
        self.max_pending_bytes = max_pending_bytes
        self._encode, self._on_written = encode, on_written
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self.dropped = self.write_errors = 0
        self.bytes_written = 0
        self._thread = threading.Thread(target=self._writer, name="kvmesh-kv-redis-writer", daemon=True)
        self._thread.start()

    def put_async(self, items: list[tuple], tag=None) -> bool:
        """Queue writes, ``(key, value)`` or ``(key, stage, body)`` (with ``encode``); False
        (nothing queued) when more than ``max_pending_bytes`` already wait. ``tag`` goes to
        ``on_written`` once the batch is written."""
        n = sum(len(it[-1]) for it in items)
        with self._lock:
            if self._pending + n > self.max_pending_bytes:
                self.dropped += len(items)
                return False
            self._pending += n
        self._queue.put((items, n, tag))
        return True

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write was attempted (tests, benchmarks)."""
        done = threading.Event()
        self._queue.put((None, done, None))
        done.wait(timeout)

    def _writer(self) -> None:
        while True:
            items, n, tag = self._queue.get()
            if items is None:
                if n is not None:
                    n.set()
                    continue
                return
            try:
                pipe = self._client.pipeline(transaction=False)
                for it in items:
                    v = self._encode(it[1], it[2]) if self._encode is not None else it[1]
                    pipe.set(it[0], v, px=int(self.ttl * 1000) if self.ttl > 0 else None)
                pipe.execute()
                self.bytes_written += n
                if tag is not None and self._on_written is not None:
                    self._on_written(tag)
            except self._errors as e:
                self.write_errors += 1
                log.debug("kv tier: redis write failed: %s", e)
            finally:
                with self._lock:
                    self._pending -= n

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` (None where missing), in one round trip. Raises TierUnavailable."""
        if not keys:
            return []
        try:
            return self._client.mget(list(keys))
        except self._errors as e:
            raise TierUnavailable(f"kv tier at {self.url}: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self._queue.put((None, None, None))
        self._thread.join(5)
        self._client.close()


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

    def flush(self) -> None:
        """Wait for queued Redis writes (tests, benchmarks)."""
        if self.redis is not None:
            self.redis.flush()

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
