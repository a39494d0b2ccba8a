"""MemoryIndex: the prefix-cache index (:mod:`kvstore.index`) in dicts of this process, the
embedded default when no Redis URL is given. :mod:`kvstore.index_redis` mirrors each method
in a Lua script.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Callable

from kvstore.events import REDIS, BlockRemoved, BlockStored, KVEvent
from kvstore.index_contract import (
    REPLICA_MEDIUMS,
    PrefixMatch,
    Snapshot,
    by_medium,
    check_events,
    shared_ttl,
)

class MemoryIndex:
    """The index in one process; every method takes one lock, so it is thread-safe and each
    call is atomic. Never raises IndexUnavailable.

    Args:
        clock: seconds, monotonic (tests may pass a fake one).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[int, dict[str, set[str]]] = {}  # block hash -> {replica: its mediums}
        self._blocks: dict[str, set[int]] = {}              # replica -> hashes it holds (any medium)
        self._seq: dict[str, int] = {}                      # replica -> last batch applied
        self._expiry: dict[str, float] = {}                 # replica -> heartbeat deadline (clock s)
        self._shared: dict[int, float] = {}                 # block hash -> deadline in the Redis tier
        self._next_sweep = 0.0

    def _drop_blocks(self, replica: str) -> None:
        for h in self._blocks.pop(replica, ()):
            holders = self._holders[h]
            del holders[replica]
            if not holders:
                del self._holders[h]

    def _store(self, replica: str, hashes: Iterable[int], medium: str) -> None:
        held = self._blocks.setdefault(replica, set())
        for h in hashes:
            self._holders.setdefault(h, {}).setdefault(replica, set()).add(medium)
            held.add(h)

    def _remove(self, replica: str, hashes: Iterable[int], medium: str) -> None:
        held = self._blocks.get(replica, set())
        for h in hashes:
            holders = self._holders.get(h, {})
            media = holders.get(replica)
            if media is None:
                continue
            media.discard(medium)
            if not media:
                del holders[replica]
                held.discard(h)
                if not holders:
                    del self._holders[h]

    def _drop_replica(self, replica: str) -> None:
        self._drop_blocks(replica)
        self._seq.pop(replica, None)
        self._expiry.pop(replica, None)

    def apply(self, replica: str, seq: int, events: Sequence[KVEvent]) -> bool:
        check_events(events)
        with self._lock:
            if seq != self._seq.get(replica, 0) + 1:
                return False
            for ev in events:
                if isinstance(ev, BlockStored) and ev.medium == REDIS:
                    deadline = self._clock() + shared_ttl(ev)
                    self._shared.update((h, deadline) for h in ev.block_hashes)
                elif isinstance(ev, BlockStored):
                    self._store(replica, ev.block_hashes, ev.medium)
                elif isinstance(ev, BlockRemoved) and ev.medium == REDIS:
                    for h in ev.block_hashes:
                        self._shared.pop(h, None)
                elif isinstance(ev, BlockRemoved):
                    self._remove(replica, ev.block_hashes, ev.medium)
                else:
                    self._remove(replica, list(self._blocks.get(replica, ())), ev.medium)
            self._seq[replica] = seq
            return True

    def resync(self, replica: str, seq: int, block_hashes: Snapshot) -> None:
        snapshot = by_medium(block_hashes)
        with self._lock:
            self._drop_blocks(replica)
            for medium, hashes in snapshot.items():
                self._store(replica, hashes, medium)
            self._seq[replica] = seq

    def heartbeat(self, replica: str, ttl: float) -> None:
        with self._lock:
            self._expiry[replica] = self._clock() + ttl

    def remove_replica(self, replica: str) -> None:
        with self._lock:
            self._drop_replica(replica)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        return self.match_tiers(block_hashes).counts()

    def match_tiers(self, block_hashes: Sequence[int]) -> PrefixMatch:
        with self._lock:
            now = self._clock()
            if now >= self._next_sweep:                     # expired shared entries, once a second
                self._shared = {h: t for h, t in self._shared.items() if t > now}
                self._next_sweep = now + 1.0
            known = self._blocks.keys() | self._seq.keys() | self._expiry.keys()
            active = set()
            for r in known:
                if self._expiry.get(r, -1.0) > now:
                    active.add(r)
                else:
                    self._drop_replica(r)
            media: dict[str, list[str | None]] = {r: [] for r in active}
            last: dict[str, int] = {}                       # replica -> its last own block in the run
            shared = 0
            for i, h in enumerate(block_hashes):
                in_shared = shared == i and self._shared.get(h, 0.0) > now
                shared += in_shared
                if not active and not in_shared:
                    break
                holders = self._holders.get(h, {})
                for r in list(active):
                    own = next((m for m in REPLICA_MEDIUMS if m in holders.get(r, ())), None)
                    if own is None and not in_shared:
                        active.discard(r)
                        continue
                    media[r].append(own)
                    if own is not None:
                        last[r] = i
            return PrefixMatch({r: tuple(media[r][:n + 1]) for r, n in last.items()}, shared)


# ---- Redis -----------------------------------------------------------------------------
# Lua scripts. ARGV[1] is always the key prefix; key names are built in the script, which
