"""BlockManager unit tests (no model): allocation, reference counts, prefix-cache hits, LRU
eviction, KV events and the block-hash chain."""

from __future__ import annotations

import copy
import os
import struct
import subprocess
import sys

import pytest
import xxhash

from kvmesh.core.sampling import SamplingParams
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored, CollectingSink
from kvstore.hashing import hash_block, hash_blocks, seed_hash
from scheduler.block_manager import BlockManager
from scheduler.request import Request

BS = 4
SEED = seed_hash("unit-test")


def bm(num_blocks=8, caching=True):
    sink = CollectingSink()
    return BlockManager(num_blocks, BS, caching, SEED, sink), sink


def req(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def prefill(m, r):
    """Admit ``r`` the way the scheduler does (prefix hits, then the rest), compute its
    whole prompt, and register its full blocks."""
    hits = m.find_cached_prefix(r)
    n = r.num_tokens - len(hits) * BS
    assert m.allocate(r, n, hits)
    r.num_computed_tokens += n
    m.cache_full_blocks(r)
    return hits


def decode(m, r, token):
    """``token`` was sampled; the next step computes its K/V (one token)."""
    r.output_token_ids.append(token)
    assert m.allocate(r, 1)
    r.num_computed_tokens += 1
    m.cache_full_blocks(r)


def events(sink, m):
    m.take_events()
    ev, sink.events = sink.events, []
    return ev


def state(m):
    return copy.deepcopy((m.ref_count, list(m.free_queue), m.cached, m.block_hash, m.queries, m.hits))


# ---------------------------------------------------------------------------------------------
# allocation and reference counts

def test_allocate_and_free():
    m, _ = bm(8)
    r = req("a", range(10))
    assert m.allocate(r, 10)
    assert len(r.block_table) == 3 and len(set(r.block_table)) == 3
    assert all(m.ref_count[b] == 1 for b in r.block_table)
    s = m.stats()
    assert (s.used, s.free, s.cached, s.num_blocks) == (3, 5, 0, 8)
    r.num_computed_tokens = 10
    assert m.allocate(r, 2)                 # 12 tokens: still 3 blocks
    assert len(r.block_table) == 3
    assert m.allocate(r, 3)                 # 13 tokens: a 4th block
    assert len(r.block_table) == 4
    m.free(r)
    assert r.block_table == [] and m.stats().used == 0 and m.num_free_blocks == 8


def test_shared_blocks_are_reference_counted():
    m, _ = bm(8)
    a = req("a", range(10))
    prefill(m, a)
    b = req("b", list(range(8)) + [99, 98, 97])
    hits = prefill(m, b)
    assert hits == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [m.ref_count[x] for x in a.block_table] == [2, 2, 1]
    assert m.stats().used == 4
    m.free(a)
    assert [m.ref_count[x] for x in b.block_table] == [1, 1, 1]
    assert m.stats().used == 3
    m.free(b)
    s = m.stats()
    assert (s.used, s.cached) == (0, 2)     # the two shared full blocks; both tails are partial


def test_cached_blocks_count_only_full_computed_blocks():
    m, _ = bm(8)
    a = req("a", range(10))                # blocks: [0-3] [4-7] [8,9]
    prefill(m, a)
    assert len(a.block_hashes) == 2
    assert {m.block_hash[x] for x in a.block_table[:2]} == set(a.block_hashes)
    assert m.block_hash[a.block_table[2]] is None
    m.free(a)
    s = m.stats()
    assert (s.used, s.cached, s.free) == (0, 2, 8)


def test_hit_counting_and_last_token_always_computed():
    m, _ = bm(16)
    a = req("a", range(12))                 # exactly 3 blocks
    assert prefill(m, a) == []
    assert (m.queries, m.hits) == (12, 0)
    m.free(a)
    again = req("again", range(12))         # fully cached: the last block is recomputed
    hits = prefill(m, again)
    assert len(hits) == 2 and again.num_cached_tokens == 8
    assert (m.queries, m.hits) == (24, 8)
    short = req("short", range(3))          # shorter than a block: no hit, no error
    assert prefill(m, short) == [] and short.num_cached_tokens == 0
    assert (m.queries, m.hits) == (27, 8)


def test_prefix_caching_disabled():
    m, sink = bm(8, caching=False)
    a = req("a", range(12))
    prefill(m, a)
    m.free(a)
    b = req("b", range(12))
    assert m.find_cached_prefix(b) == []
    assert m.stats().cached == 0 and (m.queries, m.hits) == (0, 0)
    assert events(sink, m) == []


def test_allocation_failure_changes_nothing():
    m, sink = bm(6)
    a = req("a", range(12))
    prefill(m, a)                           # 3 blocks, all full and cached
    m.free(a)
    b = req("b", range(9))
    prefill(m, b)                           # hits 2 of a's blocks, takes 1 more
    before_b = copy.deepcopy((b.block_table, b.num_computed_tokens, b.num_cached_tokens))
    c = req("c", list(range(8)) + list(range(50, 66)))      # would hit 2 blocks and need 4 more
    hits = m.find_cached_prefix(c)
    assert len(hits) == 2
    snap = state(m)
    assert not m.allocate(c, 16, hits)
    assert state(m) == snap
    assert (c.block_table, c.num_computed_tokens, c.num_cached_tokens) == ([], 0, 0)
    assert not m.allocate(b, 20)            # growth that does not fit
    assert state(m) == snap
    assert (b.block_table, b.num_computed_tokens, b.num_cached_tokens) == before_b
    assert [e for e in events(sink, m) if isinstance(e, BlockRemoved)] == []


def test_allocate_counts_free_cached_hits_against_the_pool():
    """Hits on blocks that sit in the free queue use up free blocks too."""
    m, _ = bm(4)
    a = req("a", range(8))
    prefill(m, a)
    m.free(a)                               # 2 cached free blocks, 2 empty
    b = req("b", list(range(8)) + list(range(100, 110)))     # 2 hits + 10 new tokens = 3 blocks
    hits = m.find_cached_prefix(b)
    assert len(hits) == 2
    assert not m.allocate(b, 10, hits)      # needs 3 new + 2 reused > 4 free
    assert m.allocate(b, 8, hits)           # 2 new + 2 reused == 4
    assert m.num_free_blocks == 0


# ---------------------------------------------------------------------------------------------
# eviction order

def test_lru_eviction_order():
    m, sink = bm(6)
    a = req("a", range(8))                  # 2 full blocks
    b = req("b", range(100, 108))
    prefill(m, a)
    prefill(m, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    m.free(a)                               # freed first -> evicted first, tail block first
    m.free(b)
    events(sink, m)
    order = []
    for i in range(4):
        c = req(f"c{i}", range(1000 + 10 * i, 1000 + 10 * i + 1))
        # 2 empty blocks remain first in the queue, then a's tail, a's head, b's tail, b's head
        assert m.allocate(c, 1)
        order.append(c.block_table[0])
    empties = [x for x in range(6) if x not in a_blocks + b_blocks]
    assert order == empties + [a_blocks[1], a_blocks[0]]
    removed = [h for e in events(sink, m) if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [a.block_hashes[1], a.block_hashes[0]]
    assert m.find_cached_prefix(req("a2", range(9))) == []          # a is gone
    assert m.find_cached_prefix(req("b2", range(100, 109))) == b_blocks   # b survives


def test_empty_blocks_are_reused_first():
    """A freed block without a hash (nothing reusable) is handed out before blocks never used and
    before any cached block: no cached block is evicted while an empty one is free, and the
    pool's untouched blocks (pages not yet resident) stay untouched while freed ones suffice."""
    m, sink = bm(8)
    a = req("a", range(10))                 # 2 full blocks (cached) + a partial tail (empty when freed)
    prefill(m, a)
    cached, tail = a.block_table[:2], a.block_table[2]
    m.free(a)
    b = req("b", range(500, 502))
    assert m.allocate(b, 2) and b.block_table == [tail]      # the freed tail, not an untouched block
    m.free(b)
    events(sink, m)
    c = req("c", range(600, 624))           # 6 blocks: the empty tail + the 5 untouched ones
    assert m.allocate(c, 24) and sorted(c.block_table) == sorted(set(range(8)) - set(cached))
    assert not any(isinstance(e, BlockRemoved) for e in events(sink, m))
    assert m.find_cached_prefix(req("a2", range(10))) == cached
    m.free(c)
    m.reset_prefix_cache()                  # forgotten blocks are empty: reused first too
    d = req("d", range(700, 701))
    assert m.allocate(d, 1) and d.block_table[0] in cached


def test_hit_refreshes_lru_position():
    m, sink = bm(4)
    a = req("a", range(4))
    b = req("b", range(100, 104))
    prefill(m, a)
    prefill(m, b)
    a_block, b_block = a.block_table[0], b.block_table[0]
    m.free(a)
    m.free(b)                               # queue: 2 empty, a's block, b's block
    a2 = req("a2", list(range(4)) + [7])
    assert prefill(m, a2) == [a_block]      # hit: a's block is in use again
    m.free(a2)                              # ... and now the most recently freed
    events(sink, m)
    taken = []
    for i in range(3):
        c = req(f"c{i}", [500 + i])
        assert m.allocate(c, 1)
        taken.append(c.block_table[0])
    assert a_block not in taken and b_block in taken
    removed = [h for e in events(sink, m) if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [b.block_hashes[0]]   # b evicted, a kept
    assert m.find_cached_prefix(req("a3", range(5))) == [a_block]


# ---------------------------------------------------------------------------------------------
# KV events

def test_block_stored_events_chain_parents():
    m, sink = bm(8)
    a = req("a", range(6), max_tokens=8)
    prefill(m, a)
    ev = events(sink, m)
    assert ev == [BlockStored((a.block_hashes[0],), None, BS)]
    for t in (50, 51):                      # tokens 6, 7 get K/V: block 1 becomes full
        decode(m, a, t)
    ev = events(sink, m)
    assert ev == [BlockStored((a.block_hashes[1],), a.block_hashes[0], BS)]
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], [4, 5, 50, 51])
    # a second request sharing the first block stores only its new block, parent = shared one
    b = req("b", [0, 1, 2, 3, 9, 9, 9, 9, 9])
    prefill(m, b)
    ev = events(sink, m)
    assert ev == [BlockStored((b.block_hashes[1],), a.block_hashes[0], BS)]


def test_several_blocks_in_one_event():
    m, sink = bm(8)
    a = req("a", range(13))
    prefill(m, a)
    assert events(sink, m) == [BlockStored(tuple(a.block_hashes), None, BS)]
    assert a.block_hashes == hash_blocks(SEED, list(range(13)), BS)


def test_duplicate_blocks_are_not_stored_twice():
    """Two requests that compute the same prefix in the same step: only the first one's
    blocks enter the cache; the copy is freed as a plain block."""
    m, sink = bm(8)
    a, b = req("a", range(8)), req("b", range(8))
    for r in (a, b):
        assert m.allocate(r, 8)
    for r in (a, b):
        r.num_computed_tokens = 8
        m.cache_full_blocks(r)
    ev = events(sink, m)
    assert ev == [BlockStored(tuple(a.block_hashes), None, BS)]
    assert all(m.block_hash[x] is None for x in b.block_table)
    m.free(b)
    m.free(a)
    assert m.stats().cached == 2


def test_block_removed_and_all_cleared():
    m, sink = bm(3)
    a = req("a", range(8))
    prefill(m, a)
    m.free(a)
    events(sink, m)
    big = req("big", range(200, 212))       # needs all 3 blocks: evicts both cached ones
    assert m.allocate(big, 12)
    removed = [e for e in events(sink, m) if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(a.block_hashes)
    big.num_computed_tokens = 12
    m.cache_full_blocks(big)
    m.free(big)
    events(sink, m)
    m.reset_prefix_cache()
    assert events(sink, m) == [AllBlocksCleared()]
    assert m.stats().cached == 0
    assert m.find_cached_prefix(req("big2", range(200, 213))) == []
    # reusing the blocks after a reset emits no BlockRemoved for forgotten hashes
    assert m.allocate(req("c", range(12)), 12)
    assert not [e for e in events(sink, m) if isinstance(e, BlockRemoved)]


def test_take_events_forwards_and_clears():
    m, sink = bm(4)
    prefill(m, req("a", range(4)))
    ev = m.take_events()
    assert len(ev) == 1 and sink.events == ev
    assert m.take_events() == [] and len(sink.events) == 1


# ---------------------------------------------------------------------------------------------
# hashing

# Hard-coded: these must never change (other processes and machines, the Redis prefix index,
# rely on them). Layout per kvstore/hashing.py.
SEED_VALUE = 1132923804221272035                    # seed_hash("model=test;weights=torch.float32;kv=torch.float32")
BLOCK_VALUES = [14342343036567794002, 5465465612181075515]   # hash_blocks(SEED_VALUE, range(40), 16)
EXTRA_VALUE = 18329747956992383122                  # hash_block(SEED_VALUE, range(16), "lora-a")


def test_hash_values_are_stable():
    s = seed_hash("model=test;weights=torch.float32;kv=torch.float32")
    assert s == SEED_VALUE
    assert hash_blocks(s, list(range(40)), 16) == BLOCK_VALUES
    assert hash_block(s, list(range(16)), "lora-a") == EXTRA_VALUE
    # the documented byte layout
    assert s == xxhash.xxh3_64_intdigest(b"kvmesh-v1\0model=test;weights=torch.float32;kv=torch.float32")
    assert BLOCK_VALUES[0] == xxhash.xxh3_64_intdigest(s.to_bytes(8, "little") + struct.pack("<16I", *range(16)))
    assert BLOCK_VALUES[1] == hash_block(BLOCK_VALUES[0], list(range(16, 32)))


def test_hash_values_same_in_another_process():
    code = ("from kvstore.hashing import seed_hash, hash_blocks;"
            "s = seed_hash('model=test;weights=torch.float32;kv=torch.float32');"
            "print(s, *hash_blocks(s, list(range(40)), 16))")
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env=env).stdout.split()
        assert [int(x) for x in out] == [SEED_VALUE] + BLOCK_VALUES


def test_hash_chain_depends_on_everything_before():
    a = hash_blocks(SEED, list(range(12)), BS)
    b = hash_blocks(SEED, [0, 1, 2, 99] + list(range(4, 12)), BS)      # first block differs
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]                # the whole chain differs
    assert hash_blocks(seed_hash("other model"), list(range(12)), BS)[0] != a[0]
    assert hash_blocks(SEED, list(range(14)), BS) == a                   # partial block: no hash
    assert hash_blocks(SEED, list(range(12)), BS, parent=a[0], start_block=1) == a[1:]
