"""KV events: what a replica tells the outside world about the KV blocks it can reuse.

A block manager emits ``BlockStored`` when a full block with a hash becomes reusable by
others, ``BlockRemoved`` when a hashed block is evicted (its contents overwritten), and
``AllBlocksCleared`` when the whole prefix cache is reset. With KV tiers below the pool
(:mod:`kvstore.tiers`) the engine adds the tiers' events: a block stored in (or dropped from)
the replica's host-memory tier, and a block written to the shared Redis tier. The Redis
prefix index consumes them (same model as vLLM's KV events and llm-d's precise prefix-cache
routing, whose events also name the ``medium``).

Every event names the ``medium`` (tier) it is about; the state of a block in one medium
depends only on the last event about that block in that medium:

=========  ===============================================  ====================================
medium     where the block is                               vLLM / llm-d term
=========  ===============================================  ====================================
``pool``   the replica's own KV pool (the first tier)        ``GPU``
``host``   the replica's host-memory tier (evicted blocks)   ``CPU``
``redis``  the shared Redis tier: any replica can load it;   (LMCache's remote back end)
           not the replica's, it lives ``ttl`` seconds
=========  ===============================================  ====================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

POOL, HOST, REDIS = "pool", "host", "redis"
MEDIUMS = (POOL, HOST, REDIS)


@dataclass(frozen=True)
class BlockStored:
    """Blocks became reusable from ``medium``. ``ttl``: seconds the copy lives (``redis``
    only: the Redis tier's TTL from the write; 0 = no expiry)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None     # hash of the block before the first one, None at a sequence start (or unknown)
    block_size: int
    medium: str = POOL
    ttl: float = 0.0


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks are no longer in ``medium`` (pool: evicted; host: dropped by the tier's LRU)."""

    block_hashes: tuple[int, ...]
    medium: str = POOL


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of ``medium`` is gone (the pool's prefix cache was reset)."""

    medium: str = POOL


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventSink(Protocol):
    """Receives batches of events, in order. Implementations must not block for long."""

    def publish(self, events: list[KVEvent]) -> None: ...


class CollectingSink:
    """Keeps every event in a list (tests, and the in-process default)."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def publish(self, events: list[KVEvent]) -> None:
        self.events.extend(events)
