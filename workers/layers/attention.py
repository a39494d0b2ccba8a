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
Ainslie et al. 2023) is computed without materialising repeated K/V heads: the G query heads
that share a K/V head are folded into the query-length dimension.

Shared-prefix ("cascade") decode attention: decodes whose block tables start with the same
physical blocks (prefix-cache hits on one policy document, say) attend to that prefix in
one batched pass — the prefix K/V is read once for the whole group, and each group member's
queries form the rows of one matrix product — and to their own remaining blocks separately;
the two partial softmaxes are merged with their log-sum-exp (as in FlashInfer's cascade
attention, Ye et al. 2024, and the online-softmax identity of Milakov & Gimelshein 2018).
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
    block_table: torch.Tensor | slice   # [num_blocks_of_seq] int64, or a slice for a contiguous run


@dataclass
class CascadeGroup:
    """Decode rows ``rows`` ([n] int64) whose block tables all begin with ``prefix_blocks``
    ([P] int64, full blocks); their ``decode_block_tables`` rows hold only the blocks after."""

    rows: torch.Tensor
    prefix_blocks: torch.Tensor | slice


@dataclass
class AttentionMetadata:
    """Per-step inputs to every attention layer (built once per step by the model runner).

    Attributes:
        slot_mapping: ``[T]`` int64, cache slot of each token of the batch.
        num_decode_tokens: ``Bd``; tokens ``[0, Bd)`` are single-token decodes.
        decode_block_tables: ``[Bd, max_blocks]`` int64 (padded with block 0); for rows in a
            cascade group, only the blocks after the group's shared prefix. A ``slice`` when
            ``Bd == 1`` and the blocks are a contiguous run (read as a view, no gather).
        decode_seq_lens: ``[Bd]`` int64, tokens those tables hold (including the new token).
        decode_mask: ``[Bd, 1, 1, max_blocks * block_size]`` additive mask (0 or -inf) in the
            model dtype, hiding each row's padding slots.
        cascade: groups of decode rows sharing a prefix of blocks.
        prefills: the prefill chunks, in batch order after the decodes.
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | slice | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    cascade: list[CascadeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``k, v: [T, KVH, D]`` at ``slot_mapping: [T]`` in the paged cache."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention that also returns the log-sum-exp of each query's scores.

    q: ``[B, Hk, M, D]``; k, v: ``[B, Hk, N, D]`` (any strides); mask: additive, broadcastable
    to ``[B, Hk, M, N]``, or None. Returns (out ``[B, Hk, M, D]`` in q's dtype, lse ``[B, Hk, M]``
    float32).
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse


def block_index(ids: list[int], device) -> torch.Tensor | slice:
    """Index for a list of block ids: a slice when they are one contiguous ascending run
    (then reading them is a view, not a copy), else an int64 tensor."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return slice(ids[0], ids[-1] + 1)
    return torch.tensor(ids, dtype=torch.long, device=device)


def _gather(cache: torch.Tensor, block_table: torch.Tensor | slice, length: int, dtype) -> torch.Tensor:
    """K or V of one sequence, ``[KVH, length, D]`` in ``dtype`` (``length=-1``: all blocks)."""
    kvh, d = cache.shape[2], cache.shape[3]
    kv = cache[block_table].view(-1, kvh, d)
    return (kv if length < 0 else kv[:length]).transpose(0, 1).to(dtype)


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
        # Gather each row's blocks and attend on the strided [Bd, KVH, L, D] view (no copy).
        bt = md.decode_block_tables
        L = md.decode_mask.shape[-1]
        kc = k_cache[bt].view(bd, L, KVH, D).transpose(1, 2).to(q.dtype)
        vc = v_cache[bt].view(bd, L, KVH, D).transpose(1, 2).to(q.dtype)
        qd = q[:bd].view(bd, KVH, G, D)
        if not md.cascade:
            o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=md.decode_mask, scale=scale)
            out[:bd] = o.reshape(bd, H, D)
        else:
            o, lse = attention_with_lse(qd, kc, vc, md.decode_mask, scale)
            o = o.float()
            for g in md.cascade:
                n = g.rows.shape[0]
                kp = _gather(k_cache, g.prefix_blocks, -1, q.dtype).unsqueeze(0)   # [1, KVH, P, D]
                vp = _gather(v_cache, g.prefix_blocks, -1, q.dtype).unsqueeze(0)
                qg = qd[g.rows].transpose(0, 1).reshape(1, KVH, n * G, D)
                op, lp = attention_with_lse(qg, kp, vp, None, scale)
                op = op.view(KVH, n, G, D).transpose(0, 1).float()                # [n, KVH, G, D]
                lp = lp.view(KVH, n, G).transpose(0, 1)
                ls = lse[g.rows]
                m = torch.maximum(lp, ls)
                wp, ws = torch.exp(lp - m).unsqueeze(-1), torch.exp(ls - m).unsqueeze(-1)
                o[g.rows] = (op * wp + o[g.rows] * ws) / (wp + ws)
            out[:bd] = o.to(q.dtype).reshape(bd, H, D)

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
