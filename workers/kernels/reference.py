"""Plain-PyTorch references of the native kernels (tests and ``bench/kernels.py``):
``kvmesh::paged_attention`` (:func:`paged_attention_ref`) and ``kvmesh::gguf_linear``
(:func:`gguf_linear_ref`).

``paged_attention_ref``:

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


def unpack_gguf_qweight(qweight: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`workers.kernels.gemm.pack_gguf_qweight`: uint8 ``[16 P, K]``."""
    p = qweight.shape[0]
    if bits == 8:
        return qweight.view(p, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(16 * p, k)
    ch = qweight.view(p, k // 8, 96 if bits == 6 else 64)
    b = ch[..., :64].reshape(p, k // 8, 16, 4)
    q = torch.stack([b & 0x0F, b >> 4], dim=3)                                  # [p, c, n, o, j]
    if bits == 6:
        hb = ch[..., 64:].reshape(p, k // 8, 2, 1, 16)                          # [p, c, o, 1, b]
        hi = (hb >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3     # [p, c, o, l, b]
        q = q | (hi.reshape(p, k // 8, 2, 16, 4).permute(0, 1, 3, 2, 4) << 4)   # operand byte 16 l + b = 4 n + j
    return q.permute(0, 2, 1, 3, 4).reshape(16 * p, k)


def quantize_activations(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``gguf_linear``'s activation quantization: per row and ``block`` values (32 for the
    flat scheme, the super-block for the k-quant scheme), ``dx = amax / 127``,
    ``xq = round_half_even(x * (127 / amax))`` (0 for an all-zero block), float32 math.
    Returns ``(xq float32 [M, K] of integers, dx float32 [M, K / block])``."""
    xf = x.float()
    m, k = xf.shape
    blk = xf.view(m, k // block, block)
    amax = blk.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(blk * inv[..., None]).clamp_(-127, 127)
    return xq.view(m, k), amax / 127.0


def _group_scales(scales: torch.Tensor, superscales: torch.Tensor | None, k: int, G: int):
    """The packed scales (workers/kernels/gemm.py ``pack_gguf_scales``) as per-group float64
    ``(s, z)``, each ``[16P, K / G]``: ``w = s q + z``. k-quant: ``s = d sc``, ``z = -dmin m``
    (``S = 1``: m = sc and dmin = 32 d)."""
    if superscales is None:
        s = scales[:, :, 0, :].permute(0, 2, 1).reshape(-1, k // G).double()
        z = scales[:, :, 1, :].permute(0, 2, 1).reshape(-1, k // G).double()
        return s, z
    sb = k // superscales.shape[1]
    S = scales.shape[2]
    d = superscales[:, :, 0, :].permute(0, 2, 1).reshape(-1, k // sb).double().repeat_interleave(sb // G, 1)
    dmin = (superscales[:, :, S - 1, :].permute(0, 2, 1).reshape(-1, k // sb).double().repeat_interleave(sb // G, 1)
            * (32 if S == 1 else 1))
    s = d * scales[:, :, 0, :].permute(0, 2, 1).reshape(-1, k // G).double()
    z = -dmin * scales[:, :, S - 1, :].permute(0, 2, 1).reshape(-1, k // G).double()
    return s, z


def gguf_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, superscales: torch.Tensor | None,
                    bits: int, group_size: int, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``kvmesh::gguf_linear`` in PyTorch (float64 sums): ``[M, n]`` in x's dtype."""
    k = x.shape[1]
    q = unpack_gguf_qweight(qweight, bits, k).double()                          # [16P, K]
    G = group_size
    s, z = _group_scales(scales, superscales, k, G)
    qb = 32 if superscales is None else k // superscales.shape[1]
    xq, dx = quantize_activations(x, qb)
    xq, dx = xq.double(), dx.double()
    m = x.shape[0]
    isum = torch.einsum("mgk,ngk->mng", xq.view(m, k // G, G), q.view(-1, k // G, G))    # [M, 16P, K/G]
    xsum = xq.view(m, k // G, G).sum(-1)                                                   # [M, K/G]
    dxg = dx.repeat_interleave(qb // G, 1)                                                  # [M, K/G]
    y = (dxg[:, None, :] * (s[None] * isum + z[None] * xsum[:, None, :])).sum(-1)[:, :n]
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def gguf_linear_bf16_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, superscales: torch.Tensor | None,
                         bits: int, group_size: int, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``kvmesh::gguf_linear``'s amx path for bfloat16 x of 32 rows or more: the weights
    dequantized (``s q + z``) and rounded to bfloat16, x as it is, float64 sums; ``[M, n]``
    bfloat16. The kernel rounds each weight from ``s q + z`` computed in float32 (one ulp of a
    weight may differ from this float64 rounding) and sums in float32."""
    k = x.shape[1]
    q = unpack_gguf_qweight(qweight, bits, k).double()
    G = group_size
    s, z = _group_scales(scales, superscales, k, G)
    w = (q * s.repeat_interleave(G, 1) + z.repeat_interleave(G, 1))[:n].to(torch.bfloat16).double()
    y = x.double() @ w.T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
