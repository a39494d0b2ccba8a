"""Paged attention against a dense reference, and shared-prefix (cascade) decode grouping."""

import torch

from kvmesh.core.engine_config import EngineConfig
from workers.input_batch import CASCADE_MIN_BLOCKS, cascade_groups
from workers.kv_cache import KVCache
from workers.layers.attention import AttentionMetadata, CascadeGroup, PrefillChunk, block_index, paged_attention

BS, KVH, G, D = 4, 2, 3, 8
H = KVH * G


def dense_decode(q, keys, values, scale):
    """q [H, D]; keys/values [L, KVH, D] -> [H, D]."""
    k = keys.repeat_interleave(G, dim=1).transpose(0, 1)   # [H, L, D]
    v = values.repeat_interleave(G, dim=1).transpose(0, 1)
    p = torch.softmax((q[:, None, :] @ k.transpose(-1, -2)).squeeze(1) * scale, -1)
    return (p[:, None, :] @ v).squeeze(1)


def _decode_md(tables, lens, cascade=()):
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    valid = torch.arange(width * BS)[None] < torch.tensor(lens)[:, None]
    mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(tables),
                             decode_block_tables=bt, decode_seq_lens=torch.tensor(lens), decode_mask=mask,
                             cascade=list(cascade))


def test_cascade_decode_equals_plain_decode():
    torch.manual_seed(0)
    nblocks = 40
    kc, vc = torch.randn(nblocks, BS, KVH, D), torch.randn(nblocks, BS, KVH, D)
    shared = [3, 4, 5, 6, 7]                      # 5 shared full blocks
    own = [[10, 11], [20], [30, 31, 32]]
    lens = [len(shared) * BS + 6, len(shared) * BS + 1, len(shared) * BS + 11]
    tables = [shared + o for o in own]
    q = torch.randn(3, H, D)
    empty = torch.empty(0, KVH, D)
    cache = KVCache(torch.stack((kc, vc)))
    plain = paged_attention(q, empty, empty, cache, _decode_md(tables, lens), 0.3)
    suffix_tables = [t[len(shared):] for t in tables]
    suffix_lens = [n - len(shared) * BS for n in lens]
    group = CascadeGroup(torch.tensor([0, 1, 2]), block_index(shared, "cpu"))
    casc = paged_attention(q, empty, empty, cache, _decode_md(suffix_tables, suffix_lens, [group]), 0.3)
    for i, t in enumerate(tables):
        keys = kc[t].reshape(-1, KVH, D)[:lens[i]]
        vals = vc[t].reshape(-1, KVH, D)[:lens[i]]
        ref = dense_decode(q[i], keys, vals, 0.3)
        torch.testing.assert_close(plain[i], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(casc[i], ref, atol=1e-5, rtol=1e-5)


def test_prefill_with_cached_context_equals_dense():
    torch.manual_seed(1)
    kc, vc = torch.zeros(16, BS, KVH, D), torch.zeros(16, BS, KVH, D)
    ctx, n = 7, 5                                   # 7 tokens already cached, 5 new
    table = [9, 2, 5]                               # not contiguous: gathered by index
    k_all, v_all = torch.randn(ctx + n, KVH, D), torch.randn(ctx + n, KVH, D)
    slots = [table[p // BS] * BS + p % BS for p in range(ctx + n)]
    kc.view(-1, KVH, D)[slots[:ctx]] = k_all[:ctx]
    vc.view(-1, KVH, D)[slots[:ctx]] = v_all[:ctx]
    q = torch.randn(n, H, D)
    md = AttentionMetadata(slot_mapping=torch.tensor(slots[ctx:]),
                           prefills=[PrefillChunk(0, n, ctx, block_index(table, "cpu"))])
    out = paged_attention(q, k_all[ctx:], v_all[ctx:], KVCache(torch.stack((kc, vc))), md, 0.3)
    for i in range(n):
        ref = dense_decode(q[i], k_all[:ctx + i + 1], v_all[:ctx + i + 1], 0.3)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


def test_block_index_is_a_view_only_for_contiguous_runs():
    assert block_index([4, 5, 6], "cpu") == slice(4, 7)
    assert isinstance(block_index([4, 6, 7], "cpu"), torch.Tensor)
    assert isinstance(block_index([5, 4], "cpu"), torch.Tensor)


def test_cascade_groups_split_per_document_not_per_system_prompt():
    """Two documents after a common system prompt: rows group per document (the long shared
    run), not all together on the short system-prompt run."""
    system = [1, 2]
    doc_a = list(range(100, 100 + 2 * CASCADE_MIN_BLOCKS))
    doc_b = list(range(200, 200 + 2 * CASCADE_MIN_BLOCKS))
    tables = [system + doc_a + [300], system + doc_b + [301], system + doc_a + [302], system + doc_b + [303],
              [400, 401]]
    lens = [len(t) * BS - 1 for t in tables]
    groups = cascade_groups(tables, lens, BS)
    assert sorted(sorted(rows) for rows, _ in groups) == [[0, 2], [1, 3]]
    for rows, shared in groups:
        assert shared == system + (doc_a if rows[0] == 0 else doc_b)
    assert tables[0] == [300] and lens[0] == BS - 1      # only the row's own block is left
    assert tables[4] == [400, 401]                        # ungrouped row untouched


def test_float_cache_read_of_a_contiguous_run_is_a_view():
    """Decode of one row over consecutive blocks reads the float cache without copying."""
    from workers.kv_cache import allocate_kv_cache
    cache, = allocate_kv_cache(1, 8, BS, KVH, D, torch.float32, torch.device("cpu"))
    k, v = cache.read(block_index([2, 3, 4], "cpu"), torch.float32)
    assert k.data_ptr() == cache.data[0, 2].data_ptr() and v.data_ptr() == cache.data[1, 2].data_ptr()
    assert k.shape == (3, BS, KVH, D)
