"""Attention over a paged KV cache (PagedAttention, Kwon et al. 2023, SOSP).

Each layer's cache is a :class:`workers.kv_cache.KVCache` (K and V blocks of
``[block_size, num_kv_heads, head_dim]``, float or quantized with a scale per block and KV head).
A sequence's tokens live in the blocks its *block table* lists, in order; token ``i`` of a
sequence sits at slot ``block_table[i // block_size] * block_size + i % block_size``. The
model runner computes a *slot mapping* (one slot per token in the batch) and the block
tables; this module writes the new K/V at those slots (``KVCache.write``) and reads each
sequence's K/V back through its block table (``KVCache.read``, which dequantizes a quantized
cache into the query's dtype; every path below — decode, cascade prefix, prefill after cached
context — reads through it). With a quantized cache a prefill chunk without context also
attends to its own K/V as the cache holds it (dequantized), so that outputs do not depend on
how a prompt was chunked or how much of it came from the prefix cache.

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

from workers.kv_cache import KVCache


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
class NativeMetadata:
    """Inputs of the native kernels (:mod:`workers.kernels`) for the rows ``[0, num_tokens)`` of
    the batch: the decodes, then the prefill chunks after cached context (and, with a quantized
    cache, every prefill chunk); the chunks without context of a float cache come after them
    and keep the SDPA path (``AttentionMetadata.prefills`` with ``q_start >= num_tokens``).

    Attributes:
        num_tokens: query rows the native kernel computes.
        query_start_loc: ``[S + 1]`` int32, sequence s owns rows ``[qsl[s], qsl[s + 1])``.
        seq_lens: ``[S]`` int32, keys in s's own blocks (its new tokens included).
        block_tables: ``[S, W]`` int32, padded with 0.
        prefix_group: ``[S]`` int32 cascade group of each sequence (-1: none), or None.
        prefix_block_tables: ``[G, P]`` int32, each group's shared prefix blocks (padded), or None.
        prefix_lens: ``[G]`` int32, tokens of each group's prefix, or None.
    """

    num_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    prefix_group: torch.Tensor | None = None
    prefix_block_tables: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None


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
        native: set when the native kernels compute this step (then the decode fields above
            are unset and only the prefills from ``native.num_tokens`` on use SDPA).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | slice | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    cascade: list[CascadeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    native: NativeMetadata | None = None


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


# Prefill chunks after cached context with at least this many new tokens (float cache) go
# through SDPA on the gathered context rather than the native kernel, whose many-row path
# measured slower from here up (figures: docs/engine.md, "Attention backends").
SDPA_MIN_CHUNK_TOKENS = 32


def layout_key(num_tokens: int, start: int, quantized: bool = False) -> tuple[bool, bool]:
    """A sequence's place in a step's batch, sorted ascending: decodes (one token) first, then
    the chunks after cached context shorter than ``SDPA_MIN_CHUNK_TOKENS`` (all chunks after
    context with a ``quantized`` cache), then the chunks that go through SDPA on the native
    backend (no cached context, or long). The second element is True for those SDPA chunks."""
    return num_tokens != 1, num_tokens != 1 and not quantized and (start == 0 or num_tokens >= SDPA_MIN_CHUNK_TOKENS)


def block_index(ids: list[int], device) -> torch.Tensor | slice:
    """Index for a list of block ids: a slice when they are one contiguous ascending run
    (then reading them is a view, not a copy), else an int64 tensor."""
    if ids and ids[-1] - ids[0] == len(ids) - 1 and all(b - a == 1 for a, b in zip(ids, ids[1:])):
        return slice(ids[0], ids[-1] + 1)
    return torch.tensor(ids, dtype=torch.long, device=device)


def set_decode_tables(md: AttentionMetadata, tables: list[list[int]], lens: list[int], block_size: int,
                      dtype: torch.dtype, device) -> None:
    """Fill ``md``'s decode fields from each decode row's block table (``tables``, block ids)
    and sequence length (``lens``, tokens incl. the new one): ``decode_block_tables`` (a
    slice for one row whose blocks are one contiguous run, read as a view; else ``[Bd, W]``
    int64 padded with block 0), ``decode_seq_lens`` ``[Bd]`` and the additive ``decode_mask``
    ``[Bd, 1, 1, W * block_size]`` in ``dtype`` hiding each row's padding slots."""
    width = max(len(t) for t in tables)
    if len(tables) == 1:
        bt = block_index(tables[0], device)
        if isinstance(bt, torch.Tensor):
            bt = bt[None]
    else:
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
    set_decode_tensors(md, bt, torch.tensor(lens, dtype=torch.long, device=device), width, block_size, dtype)


def set_decode_tensors(md: AttentionMetadata, block_tables: torch.Tensor | slice, seq_lens: torch.Tensor,
                       width: int, block_size: int, dtype: torch.dtype) -> None:
    """Fill ``md``'s decode fields from tensors: ``block_tables`` (``[Bd, width]`` int64, or a
    slice of ``width`` blocks when ``Bd == 1``), ``seq_lens`` (``[Bd]`` int64, tokens incl.
    the new one) and the additive ``decode_mask`` ``[Bd, 1, 1, width * block_size]`` in
    ``dtype`` (0 on each row's first ``seq_lens`` slots, -inf after)."""
    md.decode_block_tables = block_tables
    md.decode_seq_lens = seq_lens
    valid = torch.arange(width * block_size, device=seq_lens.device)[None, :] < seq_lens[:, None]
    md.decode_mask = torch.zeros(valid.shape, dtype=dtype, device=seq_lens.device).masked_fill_(
        ~valid, float("-inf"))[:, None, None, :]


def _gather(cache: KVCache, block_table: torch.Tensor | slice, length: int,
            dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence, each ``[KVH, length, D]`` in ``dtype`` (``length=-1``: all blocks)."""
    kvh, d = cache.num_kv_heads, cache.head_dim
    k, v = (x.reshape(-1, kvh, d) for x in cache.read(block_table, dtype))
    if length >= 0:
        k, v = k[:length], v[:length]
    return k.transpose(0, 1), v.transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                    md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention for a mixed batch of decodes and prefill chunks.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, KVH, D]`` for the batch's new tokens (already rotated).
        kv_cache: this layer's cache.
        md: the step's :class:`AttentionMetadata`.
        scale: softmax scale, usually ``D ** -0.5``.
    Returns:
        ``[T, H, D]`` in q's dtype.
    """
    if md.native is not None:
        return _native_attention(q, k, v, kv_cache, md, scale)
    kv_cache.write(k, v, md.slot_mapping)
    T, H, D = q.shape
    KVH = k.shape[1]
    G = H // KVH
    out = torch.empty_like(q)

    bd = md.num_decode_tokens
    if bd:
        # Gather each row's blocks and attend on the strided [Bd, KVH, L, D] view (no copy when a
        # float cache's single row reads a contiguous run; a quantized cache dequantizes here).
        L = md.decode_mask.shape[-1]
        kb, vb = kv_cache.read(md.decode_block_tables, q.dtype)
        kc = kb.view(bd, L, KVH, D).transpose(1, 2)
        vc = vb.view(bd, L, KVH, D).transpose(1, 2)
        qd = q[:bd].view(bd, KVH, G, D)
        if not md.cascade and q.device.type == "cpu" and q.dtype == torch.float32:
            # ATen's CPU flash kernel is slow for a few query rows over a long context in
            # float32 (docs/engine.md, "Paged attention"): plain matmul + softmax
            s = torch.matmul(qd, kc.transpose(-1, -2)).mul_(scale).add_(md.decode_mask)
            out[:bd] = torch.matmul(torch.softmax(s, dim=-1), vc).reshape(bd, H, D)
        elif not md.cascade:
            o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=md.decode_mask, scale=scale)
            out[:bd] = o.reshape(bd, H, D)
        else:
            o, lse = attention_with_lse(qd, kc, vc, md.decode_mask, scale)
            o = o.float()
            for g in md.cascade:
                n = g.rows.shape[0]
                kp, vp = (x.unsqueeze(0) for x in _gather(kv_cache, g.prefix_blocks, -1, q.dtype))  # [1, KVH, P, D]
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
        out[p.q_start:p.q_end] = _prefill_sdpa(q, k, v, kv_cache, p, scale)
    return out


def _prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, p: PrefillChunk,
                  scale: float) -> torch.Tensor:
    """One prefill chunk through SDPA: ``[n, H, D]`` for the chunk's rows of q. A chunk without
    cached context on a float cache attends to its own K/V (causal); after cached context, or
    on a quantized cache, it attends to what the cache holds (gathered), so a result does not
    depend on chunking or prefix-cache hits."""
    n = p.q_end - p.q_start
    G = q.shape[1] // k.shape[1]
    qp = q[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)                # [1, H, n, D]
    if p.ctx_len == 0 and not kv_cache.quantized:
        kp = k[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)
        vp = v[p.q_start:p.q_end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=G > 1)
    else:
        total = p.ctx_len + n
        kp, vp = (x.unsqueeze(0) for x in _gather(kv_cache, p.block_table, total, q.dtype))  # [1, KVH, total, D]
        # query i (absolute position ctx_len + i) sees keys 0 .. ctx_len + i
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril_(diagonal=p.ctx_len)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=G > 1)
    return o.squeeze(0).transpose(0, 1)


def _native_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                      md: AttentionMetadata, scale: float) -> torch.Tensor:
    """The step through the native kernels: K/V written at the slot mapping in place, then the
    rows ``[0, native.num_tokens)`` attend over their block tables in place (no gather); the
    remaining prefill chunks (float cache: no cached context, or at least
    ``SDPA_MIN_CHUNK_TOKENS`` new tokens) go through SDPA (:func:`_prefill_sdpa`)."""
    # the ops themselves (workers.kernels loaded them; its wrappers document them), so that
    # torch.compile sees two opaque calls
    nm = md.native
    torch.ops.kvmesh.reshape_and_cache(k, v, kv_cache.data, kv_cache.scales, md.slot_mapping)
    n = nm.num_tokens
    o = None
    if n:
        o = torch.ops.kvmesh.paged_attention(q[:n], kv_cache.data, kv_cache.scales, nm.query_start_loc,
                                             nm.seq_lens, nm.block_tables, scale, nm.prefix_group,
                                             nm.prefix_block_tables, nm.prefix_lens)
        if n == q.shape[0]:
            return o
    out = torch.empty_like(q)
    if o is not None:
        out[:n] = o
    for p in md.prefills:
        if p.q_start >= n:
            out[p.q_start:p.q_end] = _prefill_sdpa(q, k, v, kv_cache, p, scale)
    return out
