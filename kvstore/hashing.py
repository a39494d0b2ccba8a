"""Block hashing for the prefix cache.

A full KV block is identified by a chained hash: ``h_i = H(h_{i-1} || tokens_i || extra)``,
where ``h_{-1}`` is the seed derived from the model identity (path/name and every setting
that changes KV contents: KV dtype, weight format), salted by the request's ``cache_salt``
when it has one (:func:`salted_seed`). Two sequences share block ``i`` only if they share
every token up to the end of block ``i`` under the same seed and salt — the scheme of vLLM's
automatic prefix caching (its ``cache_salt`` goes into the first block's hash; here into the
root, so every hash of the chain differs). Only the 64-bit hashes leave the engine (KV
events, the prefix index): the salt itself never does.

Byte layout (stable across processes and machines; xxh3_64 with seed 0):
    seed      = xxh3_64(b"kvmesh-v1\\0" + utf8(identity))
    salted    = xxh3_64(b"kvmesh-salt\\0" + seed.to_bytes(8, "little") + utf8(cache_salt))  # salt != ""
    block_hash= xxh3_64(parent.to_bytes(8, "little") + tokens as little-endian uint32
                        + (b"\\0" + utf8(extra_key) if extra_key else b""))
Hashes are unsigned 64-bit Python ints.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash


def seed_hash(identity: str) -> int:
    """Root of every hash chain for one model/KV format. ``identity`` is a string such as
    ``"model=/path;kv_dtype=bfloat16;weights=fp32"``."""
    return xxhash.xxh3_64_intdigest(b"kvmesh-v1\0" + identity.encode("utf-8"))


def salted_seed(seed: int, cache_salt: str | None) -> int:
    """Root of a request's hash chain: ``seed`` itself without a salt (None or ""), else a
    hash of the seed and the salt, so that requests of different salts share no block."""
    if not cache_salt:
        return seed
    return xxhash.xxh3_64_intdigest(b"kvmesh-salt\0" + seed.to_bytes(8, "little") + cache_salt.encode("utf-8"))


def hash_block(parent: int, token_ids: Sequence[int], extra_key: str | None = None) -> int:
    """Hash of one full block given its parent's hash (or the seed for the first block).

    Args:
        parent: unsigned 64-bit hash of the previous block, or :func:`seed_hash` output.
        token_ids: exactly ``block_size`` token ids (each < 2**32).
        extra_key: optional string mixed in (e.g. a LoRA adapter name).
    """
    data = parent.to_bytes(8, "little") + struct.pack(f"<{len(token_ids)}I", *token_ids)
    if extra_key:
        data += b"\0" + extra_key.encode("utf-8")
    return xxhash.xxh3_64_intdigest(data)


def hash_blocks(seed: int, token_ids: Sequence[int], block_size: int,
                parent: int | None = None, start_block: int = 0, cache_salt: str | None = None) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` from block ``start_block`` on: the
    one function that hashes a request's blocks, for the block manager and the router alike.

    ``parent`` is the hash of block ``start_block - 1``; None when starting at block 0, whose
    parent is then the root ``salted_seed(seed, cache_salt)``. Returns one hash per full
    block; a trailing partial block gets none.
    """
    h = salted_seed(seed, cache_salt) if parent is None else parent
    out = []
    for b in range(start_block, len(token_ids) // block_size):
        h = hash_block(h, token_ids[b * block_size:(b + 1) * block_size])
        out.append(h)
    return out
