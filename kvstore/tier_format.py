"""The KV tiers' keys and values (:mod:`kvstore.tiers`): one value per block and pipeline stage,
checked on the way back (magic, format version, block layout, length, checksum).

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
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

FORMAT_VERSION = 1
MAGIC = b"KVMT"
_HEADER = struct.Struct("<4sHHQQ")


class TierValueError(ValueError):
    """A stored value is unusable. ``reason``: ``integrity`` (bad magic, truncated, checksum
    mismatch) or ``format`` (another format version or block layout)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

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
        tp: tensor-parallel ranks per stage; a stage's body is then its ranks' parts one after
            the other, each the layout above over its ``num_kv_heads / tp`` KV heads (the same
            bytes in all, in another order: bodies of replicas of different ``tp`` do not mix).
    """

    dtype: str
    itemsize: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    layer_ranges: tuple[tuple[int, int], ...]
    quantized: bool
    tp: int = 1

    def body_bytes(self, stage: int) -> int:
        """Bytes of one block's body for pipeline stage ``stage`` (data, then scales)."""
        start, end = self.layer_ranges[stage]
        layers = end - start
        data = layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize
        return data + (layers * 2 * self.num_kv_heads * 4 if self.quantized else 0)

    def describe(self, stage: int) -> bytes:
        start, end = self.layer_ranges[stage]
        return (f"dtype={self.dtype};bs={self.block_size};kvh={self.num_kv_heads};d={self.head_dim};"
                f"layers={start}-{end};scales={int(self.quantized)}" + (f";tp={self.tp}" if self.tp > 1 else "")).encode()


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
