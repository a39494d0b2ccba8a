"""The prefix-cache index's contract (:mod:`kvstore.index`): the :class:`PrefixIndex` protocol,
its answer :class:`PrefixMatch`, :class:`IndexUnavailable`, and the checks of events and resync
snapshots that both implementations (:mod:`kvstore.index_memory`, :mod:`kvstore.index_redis`)
share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.events import HOST, POOL, REDIS, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

REPLICA_MEDIUMS = (POOL, HOST)     # a replica's own tiers, best first
SHARED_NO_TTL = 3600.0             # seconds the index keeps a Redis-tier block written without a TTL


class IndexUnavailable(RuntimeError):
    """The index could not answer in time (Redis down or slow): route by load."""


@dataclass(frozen=True)
class PrefixMatch:
    """What the index knows of a request's leading blocks (``match_tiers``).

    Attributes:
        held: per live replica that holds some of them, its best own medium (``pool`` before
            ``host``) of each leading block, None where it holds the block in none of its own
            tiers but the shared tier does; the run ends at the first block that neither the
            replica nor the shared tier holds (trailing Nones left out). Replicas holding none
            of the leading blocks are absent.
        shared: leading blocks in the shared Redis tier (loadable by any replica).
    """

    held: dict[str, tuple[str | None, ...]] = field(default_factory=dict)
    shared: int = 0

    def counts(self) -> dict[str, int]:
        """Per replica, how many leading blocks it holds in its own tiers (first miss ends it)."""
        out = {}
        for r, media in self.held.items():
            n = next((i for i, m in enumerate(media) if m is None), len(media))
            if n:
                out[r] = n
        return out


Snapshot = Iterable[int] | Mapping[str, Iterable[int]]


class PrefixIndex(Protocol):
    def apply(self, replica: str, seq: int, events: Sequence[KVEvent]) -> bool:
        """Apply one batch of a replica's KV events numbered seq (1, 2, ... per replica). Returns False
        (applies nothing) when seq is not the next expected number: the caller must resync. Raises
        IndexUnavailable; ValueError for an event of an unknown medium (or clearing the shared tier)."""

    def resync(self, replica: str, seq: int, block_hashes: Snapshot) -> None:
        """Replace everything known about replica by block_hashes: every block its pool holds now
        (an iterable of hashes), or ``{medium: hashes}`` for its ``pool`` and ``host`` tiers; the next
        batch expected is seq + 1. Shared (``redis``) entries stay. Raises IndexUnavailable."""

    def heartbeat(self, replica: str, ttl: float) -> None:
        """replica is alive for ttl more seconds. Raises IndexUnavailable."""

    def remove_replica(self, replica: str) -> None:
        """Drop every entry of replica (shut down, or declared dead). Raises IndexUnavailable."""

    def match_tiers(self, block_hashes: Sequence[int]) -> PrefixMatch:
        """The tiers of the leading blocks of block_hashes (:class:`PrefixMatch`), live replicas only.
        Raises IndexUnavailable. Replicas whose heartbeat expired have all their entries dropped
        (lazily, here or in a sweep)."""

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """For each live replica, the number of leading blocks of block_hashes it holds in its own
        tiers, stopping at its first miss (``match_tiers(...).counts()``). Replicas with 0 may be
        left out. Raises IndexUnavailable."""


def check_events(events: Sequence[KVEvent]) -> None:
    """Raise TypeError for an item that is not a KV event, ValueError for a medium other than a
    replica's own (:data:`REPLICA_MEDIUMS`) or ``redis`` (which cannot be cleared)."""
    for ev in events:
        if not isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise TypeError(f"not a KV event: {ev!r}")
        if ev.medium not in REPLICA_MEDIUMS and not (ev.medium == REDIS and not isinstance(ev, AllBlocksCleared)):
            raise ValueError(f"KV event medium must be one of {REPLICA_MEDIUMS + (REDIS,)} "
                             f"(and the shared {REDIS!r} tier cannot be cleared): {ev!r}")


def by_medium(block_hashes: Snapshot) -> dict[str, list[int]]:
    """A resync snapshot as ``{medium: hashes}`` (a plain iterable: the pool's)."""
    if not isinstance(block_hashes, Mapping):
        return {POOL: list(block_hashes)}
    bad = set(block_hashes) - set(REPLICA_MEDIUMS)
    if bad:
        raise ValueError(f"resync: mediums must be among {REPLICA_MEDIUMS}, got {sorted(bad)}")
    return {m: list(hs) for m, hs in block_hashes.items()}


def shared_ttl(ev: BlockStored) -> float:
    """Seconds the index keeps the Redis-tier blocks of ``ev``: its ``ttl``, else :data:`SHARED_NO_TTL`."""
    return ev.ttl if ev.ttl > 0 else SHARED_NO_TTL
