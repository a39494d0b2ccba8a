"""A request's greedy output does not depend on how it was scheduled.

Reference: every request run alone (prefix caching off). Variants run the 16 requests
together: continuous batching with and without prefix caching, a KV pool so small that
requests get preempted and recomputed, a 16-token budget that chunks every prefill, static
batching and naive (one at a time, no KV reuse). Half of the prompts share a 32-token prefix
so that the prefix cache really serves blocks.

Runs on the tiny random Llama (cheap, all 16 requests everywhere) and on SmolLM2 (real
weights; the naive policy recomputes the whole sequence every step, so it gets a subset).
"""

from __future__ import annotations

import pytest
import torch

LENGTHS = [1, 3, 15, 16, 17, 20, 31, 32, 33, 40, 47, 48, 49, 64, 70, 90]
SHARED = 32          # prompts of length > SHARED at odd indexes start with the same 32 tokens


def _prompts(stream: list[int]) -> list[list[int]]:
    """16 prompts of LENGTHS from a token stream; odd-index prompts longer than SHARED share
    the stream's first SHARED tokens, the others start at distinct offsets."""
    prompts = []
    for i, n in enumerate(LENGTHS):
        if i % 2 and n > SHARED:
            p = stream[:SHARED] + stream[100 + 3 * i: 100 + 3 * i + n - SHARED]
        else:
            p = stream[40 + 9 * i: 40 + 9 * i + n]
        assert len(p) == n
        prompts.append(p)
    return prompts


@pytest.fixture(scope="module", params=["tiny_llama", "smollm2"])
def setup(request, h):
    """(name, base engine, prompts, max_tokens, reference outputs computed alone)."""
    if request.param == "tiny_llama":
        d = request.getfixturevalue("tiny_llama_dir")
        stream = torch.randint(0, 512, (800,), generator=torch.Generator().manual_seed(5)).tolist()
        max_tokens = 16
    else:
        d = request.getfixturevalue("smollm2_dir")
        stream = request.getfixturevalue("prose_ids")
        max_tokens = 10
    prompts = _prompts(stream)
    base = h.make_engine(d, enable_prefix_caching=False, max_model_len=256)
    ref = []
    for i, p in enumerate(prompts):
        r = h.run(base, [(f"alone-{i}", p, h.greedy(max_tokens))])[f"alone-{i}"]
        ref.append(r.output_token_ids)
    assert base.num_steps >= len(prompts) * max_tokens      # really one at a time
    # context matters: prompts sharing a prefix still produce different continuations
    assert len({tuple(o) for o in ref}) >= len(ref) - 1
    return request.param, base, prompts, max_tokens, ref


def _run_batch(h, engine, prompts, max_tokens, tag):
    reqs = h.run(engine, [(f"{tag}-{i}", p, h.greedy(max_tokens)) for i, p in enumerate(prompts)])
    assert engine.stats().used == 0
    return [reqs[f"{tag}-{i}"] for i in range(len(prompts))]


def _assert_same(reqs, ref, idx=None):
    idx = range(len(ref)) if idx is None else idx
    for r, i in zip(reqs, idx):
        assert r.output_token_ids == ref[i], f"request {i} (prompt length {LENGTHS[i]})"


def test_batch_of_16_no_prefix_cache(setup, h):
    name, base, prompts, mt, ref = setup
    eng = h.derive_engine(base, enable_prefix_caching=False)
    reqs = _run_batch(h, eng, prompts, mt, "batch-nocache")
    _assert_same(reqs, ref)
    assert eng.scheduler.num_preemptions == 0
    assert eng.num_steps == mt          # one prefill step for all, then batched decodes
    assert all(r.num_cached_tokens == 0 for r in reqs)


def test_batch_of_16_prefix_cache(setup, h):
    name, base, prompts, mt, ref = setup
    eng = h.derive_engine(base, enable_prefix_caching=True)
    # warm the cache with the shared prefix, so the batch gets hits from its first step
    h.run(eng, [("warm", prompts[-1], h.greedy(1))])
    reqs = _run_batch(h, eng, prompts, mt, "batch-cache")
    _assert_same(reqs, ref)
    sharing = [i for i, n in enumerate(LENGTHS) if i % 2 and n > SHARED]
    for i in sharing:
        assert reqs[i].num_cached_tokens >= SHARED, f"request {i} got no prefix hit"
    # prompts[-1] itself: all its full blocks but the last are cached
    assert reqs[-1].num_cached_tokens == (LENGTHS[-1] - 1) // 16 * 16


def test_preemption(setup, h):
    name, base, prompts, mt, ref = setup
    # SmolLM2 is slow on the CPU: only the prefix-cached variant there
    for caching in ((False, True) if name == "tiny_llama" else (True,)):
        eng = h.derive_engine(base, num_blocks=10, enable_prefix_caching=caching)
        reqs = _run_batch(h, eng, prompts, mt, f"preempt-{caching}")
        assert eng.scheduler.num_preemptions > 0
        assert sum(r.num_preemptions for r in reqs) == eng.scheduler.num_preemptions
        _assert_same(reqs, ref)
        # num_cached_tokens reports the first schedule's prefix hits: a prompt that shares no
        # prefix with another has none, even if it was preempted and re-admitted onto its own
        # cached blocks
        for i, r in enumerate(reqs):
            if not (i % 2 and LENGTHS[i] > SHARED):
                assert r.num_cached_tokens == 0, f"request {i}, preempted {r.num_preemptions}x"


def test_chunked_prefill_small_budget(setup, h):
    name, base, prompts, mt, ref = setup
    for caching in ((False, True) if name == "tiny_llama" else (False,)):
        eng = h.derive_engine(base, max_num_batched_tokens=16, enable_prefix_caching=caching)
        reqs = _run_batch(h, eng, prompts, mt, f"chunk-{caching}")
        _assert_same(reqs, ref)
        assert eng.num_steps >= sum(LENGTHS) // 16


def test_static_policy(setup, h):
    name, base, prompts, mt, ref = setup
    eng = h.derive_engine(base, policy="static", max_num_seqs=6)
    reqs = _run_batch(h, eng, prompts, mt, "static")
    _assert_same(reqs, ref)
    assert eng.num_steps == 3 * mt       # three batches of <= 6, each exactly max_tokens steps


def test_naive_policy(setup, h):
    name, base, prompts, mt, ref = setup
    idx = list(range(16)) if name == "tiny_llama" else [0, 3, 8, 11]
    eng = h.derive_engine(base, policy="naive")
    assert not eng.cfg.enable_prefix_caching
    reqs = _run_batch(h, eng, [prompts[i] for i in idx], mt, "naive")
    _assert_same(reqs, ref, idx)
    assert eng.num_steps == len(idx) * mt
