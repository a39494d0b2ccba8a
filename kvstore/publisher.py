"""KV event publisher: one replica's block-manager events → the prefix index.

The block manager calls :meth:`KVEventPublisher.publish` from the engine thread every step
(under the engine lock); it only appends to a queue. A background thread numbers batches
and applies them to the index, heartbeats, and resyncs the replica whenever the index may
have missed something:

- at start (the index may hold a previous incarnation of this replica id),
- when ``apply`` returns False (the index lost or skipped a batch: Redis restarted, the
  replica was dropped after a missed heartbeat, ...); each heartbeat goes with a batch,
  empty if no event is pending, so that an idle replica finds this out too,
- after any IndexUnavailable (the batch in flight may or may not have been applied, and
  events are dropped while the index is down), retried every ``retry_interval``.

Why a resync may discard queued events: it first drains the queue, then takes the snapshot,
then writes it. The discarded events happened before the snapshot, so it reflects them.
Events queued after the drain are applied after the snapshot; some of them may already be
reflected in it, which is harmless: the index's state of a block only depends on the last
event about it (stored, removed or cleared), so replaying events the snapshot already
reflects, in order, leaves it unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from kvstore.events import KVEvent
from kvstore.index_contract import IndexUnavailable, PrefixIndex, Snapshot

log = logging.getLogger(__name__)


class KVEventPublisher:
    """A :class:`kvstore.events.KVEventSink` that keeps ``index`` current for one replica.

    Args:
        index: the prefix index (:class:`kvstore.index_memory.MemoryIndex` or
            :class:`kvstore.index_redis.RedisIndex`).
        replica_id: this replica's id in the index (the router uses "<scheduler id>/<index>").
        snapshot: returns the hashes of every block in the replica's prefix cache, e.g.
            ``BlockManager.cached_block_hashes`` called under the engine lock, or
            ``{medium: hashes}`` for its pool and host tier (:meth:`PrefixIndex.resync`). Called from
            the publisher thread, possibly as soon as it starts; an exception is logged,
            counted in ``failures`` and retried.
        heartbeat_interval: seconds between heartbeats.
        ttl: seconds the replica stays live after each heartbeat (> heartbeat_interval).
        retry_interval: seconds between attempts while the index is unavailable.

    Counters (plain ints, written by the publisher thread only): ``batches`` (non-empty)
    and ``events`` applied, ``resyncs`` done, ``failures`` (index unavailable or snapshot
    errors), ``seq`` (the last number used, by a batch, empty ones included, or a resync).
    """

    def __init__(self, index: PrefixIndex, replica_id: str, snapshot: Callable[[], Snapshot], *,
                 heartbeat_interval: float = 1.0, ttl: float = 3.0, retry_interval: float = 0.2):
        if ttl <= heartbeat_interval:
            raise ValueError(f"ttl ({ttl} s) must exceed heartbeat_interval ({heartbeat_interval} s)")
        self.index, self.replica_id, self.snapshot = index, replica_id, snapshot
        self.heartbeat_interval, self.ttl, self.retry_interval = heartbeat_interval, ttl, retry_interval
        self.batches = self.events = self.resyncs = self.failures = self.seq = 0
        self._queue: deque[list[KVEvent]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._need_resync = True
        self._next_heartbeat = 0.0
        self._thread = threading.Thread(target=self._run, name=f"kv-publisher-{replica_id}", daemon=True)
        self._thread.start()

    # ---- engine thread -----------------------------------------------------------------
    def publish(self, events: list[KVEvent]) -> None:
        """Queue a batch of events (never blocks, never raises; ignored after close)."""
        if events and not self._stop.is_set():
            self._queue.append(list(events))
            self._wake.set()

    # ---- publisher thread ----------------------------------------------------------------
    def _drain(self) -> list[KVEvent]:
        out: list[KVEvent] = []
        while self._queue:
            out += self._queue.popleft()
        return out

    def _heartbeat(self) -> None:
        self.index.heartbeat(self.replica_id, self.ttl)
        self._next_heartbeat = time.monotonic() + self.heartbeat_interval

    def _resync(self) -> None:
        self._heartbeat()                  # first: match drops a replica without a live heartbeat
        self._drain()                      # reflected in the snapshot taken next
        hashes = self.snapshot()
        self.seq += 1
        self.index.resync(self.replica_id, self.seq, hashes)
        self._need_resync = False
        self.resyncs += 1

    def _step(self) -> None:
        beat = time.monotonic() >= self._next_heartbeat
        if self._need_resync:
            self._resync()
        elif beat:
            self._heartbeat()
        events = self._drain()
        # With each heartbeat goes a batch, empty if need be: an index that forgot this
        # replica (Redis restarted empty, the replica was dropped or removed) refuses it,
        # and the resync follows within a heartbeat interval even on an idle replica.
        if events or beat:
            self.seq += 1
            if self.index.apply(self.replica_id, self.seq, events):
                self.batches += bool(events)
                self.events += len(events)
            else:
                log.info("prefix index: batch %d of %s out of sequence, resyncing", self.seq, self.replica_id)
                self._resync()

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self._step()
                if failing:
                    log.warning("prefix index: %s publishing again", self.replica_id)
                failing = False
            except Exception as e:        # IndexUnavailable, or the snapshot failed
                self.failures += 1
                self._need_resync = True   # which heartbeats first
                self._drain()              # bounded memory while down; the resync covers them
                if not failing:
                    log.warning("prefix index: %s cannot publish (%s: %s); retrying every %.2f s",
                                self.replica_id, type(e).__name__, e, self.retry_interval,
                                exc_info=not isinstance(e, IndexUnavailable))
                failing = True
                self._stop.wait(self.retry_interval)
                continue
            self._wake.wait(max(0.0, self._next_heartbeat - time.monotonic()))
            self._wake.clear()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (pending events are dropped) and remove the replica from the index.
        An unavailable index is logged, not raised: its heartbeat will expire. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        try:
            self.index.remove_replica(self.replica_id)
        except IndexUnavailable as e:
            self.failures += 1
            log.warning("prefix index: could not remove %s (%s); its entries expire with its heartbeat",
                        self.replica_id, e)
