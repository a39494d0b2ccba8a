"""The two stores below a replica's KV pool (:mod:`kvstore.tiers`): :class:`HostTier`, an LRU in
this process's memory bounded in bytes, and :class:`RedisTier`, a shared Redis written by a
background thread, with a TTL. Both hold encoded values (:mod:`kvstore.tier_format`) by key.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence

log = logging.getLogger("kvmesh.kvstore")

class TierUnavailable(RuntimeError):
    """The Redis tier could not answer (down, refused, timed out)."""


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

    @property
    def pending_bytes(self) -> int:
        """Bytes of writes queued and not yet attempted."""
        return self._pending

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
