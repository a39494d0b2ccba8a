"""Copy whole KV blocks out of a pool and back in (the KV tiers' worker side, :mod:`kvstore.tiers`).

One block's body covers the layers of this process's caches (all layers, or one pipeline
stage's), as raw bytes in the cache's own dtype:

    data   [layers, 2, block_size, kv_heads, head_dim]   (K = 0, V = 1)
    scales [layers, 2, kv_heads] float32                 (quantized caches only)

so a block comes back bit for bit as it left (int8 / fp8 values with their scales).
"""

from __future__ import annotations

import torch

from workers.kv_cache import KVCache


def block_body_bytes(caches: list[KVCache]) -> int:
    """Bytes of one block's body for these caches."""
    if not caches:
        return 0
    c = caches[0]
    per_layer = 2 * c.block_size * c.num_kv_heads * c.head_dim * c.data.element_size()
    return len(caches) * (per_layer + (2 * c.num_kv_heads * 4 if c.quantized else 0))


def save_blocks(caches: list[KVCache], block_ids: list[int]) -> list[bytes]:
    """The bodies of blocks ``block_ids`` (one ``bytes`` per block, the layout above)."""
    if not block_ids or not caches:
        return [b""] * len(block_ids)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=caches[0].data.device)
    # [L, 2, n, BS, KVH, D * itemsize] -> [n, L, 2, BS, KVH, D * itemsize]
    data = torch.stack([c.data.view(torch.uint8).index_select(1, idx) for c in caches])
    data = data.permute(2, 0, 1, 3, 4, 5).reshape(len(block_ids), -1).cpu()
    if caches[0].quantized:
        sc = torch.stack([c.scales.index_select(1, idx) for c in caches])          # [L, 2, n, KVH]
        sc = sc.permute(2, 0, 1, 3).contiguous().view(torch.uint8).reshape(len(block_ids), -1).cpu()
        data = torch.cat([data, sc], dim=1)
    rows = data.contiguous().numpy()
    return [rows[i].tobytes() for i in range(len(block_ids))]


def load_blocks(caches: list[KVCache], block_ids: list[int], bodies: list[bytes]) -> None:
    """Write ``bodies`` (from :func:`save_blocks` of caches of the same layout) into blocks
    ``block_ids``. Raises ValueError when a body has the wrong size."""
    if not block_ids or not caches:
        return
    n, size = len(block_ids), block_body_bytes(caches)
    bad = next((len(b) for b in bodies if len(b) != size), None)
    if bad is not None or len(bodies) != n:
        raise ValueError(f"KV block bodies: expected {n} of {size} bytes, got {len(bodies)} ({bad} bytes)")
    c0 = caches[0]
    dev = c0.data.device
    raw = torch.frombuffer(bytearray(b"".join(bodies)), dtype=torch.uint8).view(n, size)
    L, kvh = len(caches), c0.num_kv_heads
    row = c0.data.element_size() * c0.head_dim
    n_data = L * 2 * c0.block_size * kvh * row
    data = raw[:, :n_data].reshape(n, L, 2, c0.block_size, kvh, row).permute(1, 2, 0, 3, 4, 5).to(dev)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=dev)
    for layer, c in enumerate(caches):
        c.data.view(torch.uint8)[:, idx] = data[layer]
    if c0.quantized:
        sc = raw[:, n_data:].contiguous().view(torch.float32).reshape(n, L, 2, kvh).permute(1, 2, 0, 3).to(dev)
        for layer, c in enumerate(caches):
            c.scales[:, idx] = sc[layer]
