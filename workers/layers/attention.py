"""Attention over a paged KV cache (PagedAttention, Kwon et al. 2023, SOSP).

Each layer's cache is ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]``.
A sequence's tokens live in the blocks its *block table* lists, in order; token ``i`` of a
sequence sits at slot ``block_table[i // block_size] * block_size + i % block_size``. The
model runner computes a *slot mapping* (one slot per token in the batch) and the block
tables; this module writes the new K/V at those slots and reads each sequence's K/V back
through its block table.

A batch is laid out with all decode tokens first (one query token per sequence), then the
prefill chunks (several query tokens per sequence, possibly after ``ctx_len`` tokens already
in the cache: a prefix-cache hit or an earlier chunk). Grouped-query attention (GQA;
Ainslie et al. 2023) is computed without materialising repeated K/V heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One prefill sequence in the batch: query tokens ``[q_start, q_end)`` of the flattened
    batch, with ``ctx_len`` earlier tokens of this sequence already in the cache."""

    q_start: int
    q_end: int
    ctx_len: int
    block_table: torch.Tensor   # [num_blocks_of_seq] int64


@dataclass
class AttentionMetadata:
    """Per-step inputs to every attention layer (built once per step by the model runner).

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot of each token of the batch.
        num_decode_tokens: ``Bd``; tokens ``[0, Bd)`` are single-token decodes.
        decode_block_tables: ``[Bd, max_blocks]`` int64 (padded with block 0).
        decode_seq_lens: ``[Bd]`` int64, context length including the new token.
        prefills: the prefill chunks, in batch order after the decodes.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None   # [Bd, 1, 1, L] bool, derived once per step
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k, v: [T, KVH, D]`` at ``slot_mapping: [T]`` in the paged cache."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, dtype) -> torch.Tensor:
    """K or V of one sequence, ``[KVH, length, D]`` in ``dtype``."""
    kvh, d = cache.shape[2], cache.shape[3]
    return cache[block_table].view(-1, kvh, d)[:length].transpose(0, 1).to(dtype)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention for a mixed batch of decodes and prefill chunks.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, KVH, D]`` for the batch's new tokens (already rotated).
        k_cache, v_cache: this layer's cache ``[num_blocks, block_size, KVH, D]``.
        md: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``D ** -0.5``.
    Returns:
        ``[T, H, D]`` in q's dtype.
    """
    write_kv(k_cache, v_cache, k, v, md.slot_mapping)
    T, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    out = torch.empty_like(q)

    bd = md.num_decode_tokens
    if bd:
        bt = md.decode_block_tables
        L = bt.shape[1] * k_cache.shape[1]
        kc = k_cache[bt].view(bd, L, KVH, D).transpose(1, 2).to(q.dtype)     # [Bd, KVH, L, D]
        vc = v_cache[bt].view(bd, L, KVH, D).transpose(1, 2).to(q.dtype)
        qd = q[:bd].view(bd, KVH, G, D)
        scores = torch.matmul(qd, kc.transpose(-1, -2)).mul_(scale)            # [Bd, KVH, G, L]
        scores.masked_fill_(~md.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[:bd] = torch.matmul(probs, vc).view(bd, H, D)

    for p in md.prefills:
        n = p.q_end - p.q_start
        qp = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)                # [1, H, n, D]
        if p.ctx_len == 0:
            kp = k[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)
            vp = v[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                               enable_gqa=G > 1)
        else:
            total = p.ctx_len + n
            kp = _gather(k_cache, p.block_table, total, q.dtype).unsqueeze(0)  # [1, KVH, total, D]
            vp = _gather(v_cache, p.block_table, total, q.dtype).unsqueeze(0)
            # query i (absolute position ctx_len + i) sees keys 0 .. ctx_len + i
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril_(diagonal=p.ctx_len)
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                               enable_gqa=G > 1)
        out[p.q_start:p.q_end] = o.squeeze(0).transpose(0, 1)
    return out
