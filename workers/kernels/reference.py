"""Plain-PyTorch reference for ``kvmesh::paged_attention`` (tests and ``bench/kernels.py``).

Same arguments as :func:`workers.kernels.paged_attention`, computed one sequence at a time the
way ``workers/layers/attention.py`` does: gather the sequence's K/V through ``KVCache.read``
(a quantized cache is dequantized there), prepend the cascade prefix's K/V, and run
``F.scaled_dot_product_attention`` with the causal mask aligned to the end of the keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kv_cache import KVCache


def paged_attention_ref(q: torch.Tensor, kv_data: torch.Tensor, scales: torch.Tensor | None,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, prefix_group: torch.Tensor | None = None,
                        prefix_block_tables: torch.Tensor | None = None, prefix_lens: torch.Tensor | None = None,
                        compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[T, H, D]`` in q's dtype, computed in ``compute_dtype`` (default: q's dtype).

    Pass ``compute_dtype=torch.float32`` for a float32 reference of low-precision inputs
    (the kernels accumulate in float32)."""
    cache = KVCache(kv_data, scales)
    T, H, D = q.shape
    kvh, bs = cache.num_kv_heads, cache.block_size
    cd = compute_dtype or q.dtype
    out = torch.zeros(T, H, D, dtype=q.dtype)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s in range(len(lens)):
        a, b = qsl[s], qsl[s + 1]
        n, length = b - a, lens[s]
        if n == 0:
            continue
        nb = (length + bs - 1) // bs
        k, v = (x.reshape(-1, kvh, D)[:length] for x in cache.read(block_tables[s, :nb].long(), cd))
        ctx = length - n
        if prefix_group is not None and int(prefix_group[s]) >= 0:
            g = int(prefix_group[s])
            plen = int(prefix_lens[g])
            pnb = (plen + bs - 1) // bs
            kp, vp = (x.reshape(-1, kvh, D)[:plen] for x in cache.read(prefix_block_tables[g, :pnb].long(), cd))
            k, v = torch.cat((kp, k)), torch.cat((vp, v))
            ctx += plen
        total = k.shape[0]
        mask = torch.ones(n, total, dtype=torch.bool).tril_(diagonal=ctx)
        o = F.scaled_dot_product_attention(q[a:b].to(cd).transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                           enable_gqa=H != kvh)
        out[a:b] = o[0].transpose(0, 1).to(q.dtype)
    return out
