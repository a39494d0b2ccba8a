"""KV events: what a block manager tells the outside world about its prefix cache.

A block manager emits ``BlockStored`` when a full block with a hash becomes reusable by
others, ``BlockRemoved`` when a hashed block is evicted (its contents overwritten), and
``AllBlocksCleared`` when the whole cache is reset. The Redis prefix index consumes these
(same model as vLLM's KV events and llm-d's precise prefix-cache routing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_hash: int | None     # hash of the block before the first one, None at a sequence start
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


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
