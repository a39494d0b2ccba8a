"""Automatic prefix caching through the engine: exact hit counts, edge cases, and outputs equal
to those computed without the cache. Tiny random Llama (block size 16)."""

from __future__ import annotations

import pytest
import torch

from kvstore.events import BlockRemoved, BlockStored, CollectingSink


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, h):
    """(engine with prefix caching, engine without). Each has its own KV pool: an engine sharing
    the cached engine's pool (``derive_engine``) would overwrite blocks that the cached engine
    still keeps in its prefix cache, and a later hit on them would read another engine's K/V."""
    cached = h.make_engine(tiny_llama_dir)
    assert cached.cfg.enable_prefix_caching
    plain = h.make_engine(tiny_llama_dir, enable_prefix_caching=False)
    return cached, plain


@pytest.fixture
def tokens():
    g = torch.Generator().manual_seed(99)
    return lambda n: torch.randint(0, 512, (n,), generator=g).tolist()


def _one(h, eng, rid, prompt, n=8):
    return h.run(eng, [(rid, prompt, h.greedy(n))])[rid]


def _delta(before, after):
    return after.prefix_cache_queries - before.prefix_cache_queries, after.prefix_cache_hits - before.prefix_cache_hits


def test_three_shared_blocks_hit_exactly(engines, tokens, h):
    eng, plain = engines
    shared = tokens(48)
    a = _one(h, eng, "share-a", shared + tokens(7))
    assert a.num_cached_tokens == 0
    b_prompt = shared + tokens(11)
    s0 = eng.stats()
    b = _one(h, eng, "share-b", b_prompt)
    assert b.num_cached_tokens == 48
    assert _delta(s0, eng.stats()) == (len(b_prompt), 48)
    assert b.output_token_ids == _one(h, plain, "share-b-plain", b_prompt).output_token_ids
    # and the outputs differ from a's, so the suffix really was computed
    assert b.output_token_ids != a.output_token_ids


def test_partial_share_hits_only_full_blocks(engines, tokens, h):
    eng, plain = engines
    shared = tokens(40)                      # 2 full blocks + 8 tokens shared
    _one(h, eng, "partial-a", shared + tokens(20))
    p = shared + tokens(20)
    b = _one(h, eng, "partial-b", p)
    assert b.num_cached_tokens == 32
    assert b.output_token_ids == _one(h, plain, "partial-b-plain", p).output_token_ids


def test_short_prompt_gets_no_hit(engines, tokens, h):
    eng, plain = engines
    p = tokens(10)
    first = _one(h, eng, "short-1", p)
    s0 = eng.stats()
    again = _one(h, eng, "short-2", p)
    assert again.num_cached_tokens == 0
    assert _delta(s0, eng.stats())[1] == 0
    assert again.output_token_ids == first.output_token_ids


@pytest.mark.parametrize("n", [16, 48, 50])
def test_fully_cached_prompt_recomputes_last_block(engines, tokens, h, n):
    """A prompt whose every full block is cached still computes at least one token (the model
    needs a query to produce logits): with n = 48 the third block is recomputed."""
    eng, plain = engines
    p = tokens(n)
    first = _one(h, eng, f"full-{n}-1", p)
    again = _one(h, eng, f"full-{n}-2", p)
    assert again.num_cached_tokens == (n - 1) // 16 * 16
    assert again.output_token_ids == first.output_token_ids
    assert again.output_token_ids == _one(h, plain, f"full-{n}-plain", p).output_token_ids


def test_generated_tokens_are_cached(engines, tokens, h):
    """Full blocks of generated text are cached too (multi-turn reuse)."""
    eng, plain = engines
    p = tokens(40)
    a = _one(h, eng, "gen-a", p, n=24)          # 64 tokens, 63 with K/V: 3 full blocks
    follow = p + a.output_token_ids + tokens(5)
    b = _one(h, eng, "gen-b", follow)
    assert b.num_cached_tokens == 48
    assert b.output_token_ids == _one(h, plain, "gen-b-plain", follow).output_token_ids


def test_no_caching_means_no_hits(engines, tokens, h):
    eng, plain = engines
    p = tokens(40)
    _one(h, plain, "nc-1", p)
    s0 = plain.stats()
    r = _one(h, plain, "nc-2", p)
    assert r.num_cached_tokens == 0
    assert _delta(s0, plain.stats()) == (0, 0)


def test_kv_events_from_engine(tiny_llama_dir, tokens, h):
    """BlockStored for each newly cached block (chained by parent hash), BlockRemoved when a
    cached block is evicted to make room."""
    from kvmesh.core.engine_config import EngineConfig
    from scheduler.engine import LLMEngine
    sink = CollectingSink()
    eng = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_model_len=512), num_blocks=6,
                    kv_event_sink=sink)
    p = tokens(40)
    r = _one(h, eng, "ev-a", p, n=2)             # 41 tokens with K/V -> 2 full blocks
    stored = [e for e in sink.events if isinstance(e, BlockStored)]
    hashes = [x for e in stored for x in e.block_hashes]
    assert hashes == r.block_hashes[:2]
    assert stored[0].parent_hash is None and stored[0].block_size == 16
    for e in stored[1:]:
        assert e.parent_hash == hashes[hashes.index(e.block_hashes[0]) - 1]
    assert not any(isinstance(e, BlockRemoved) for e in sink.events)
    # a 90-token request needs all 6 blocks: both cached blocks are evicted
    _one(h, eng, "ev-b", tokens(90), n=2)
    removed = [x for e in sink.events if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert sorted(removed) == sorted(hashes)


def test_burst_on_one_prefix_computes_it_once(engines, tokens, h):
    """Prefix-aware admission: requests submitted together that share full blocks wait for the
    first one to compute them instead of computing the same K/V in parallel."""
    eng, plain = engines
    g = torch.Generator().manual_seed(4242)   # a prefix no earlier test has cached
    shared = torch.randint(0, 512, (64,), generator=g).tolist()   # 4 full blocks
    prompts = {f"burst-{i}": shared + tokens(5 + i) for i in range(4)}
    s0 = eng.stats()
    got = h.run(eng, [(rid, p, h.greedy(6)) for rid, p in prompts.items()])
    hits = sorted(got[rid].num_cached_tokens for rid in prompts)
    assert hits == [0, 64, 64, 64]
    assert _delta(s0, eng.stats())[1] == 3 * 64
    ref = h.run(plain, [(rid + "-plain", p, h.greedy(6)) for rid, p in prompts.items()])
    for rid in prompts:
        assert got[rid].output_token_ids == ref[rid + "-plain"].output_token_ids
