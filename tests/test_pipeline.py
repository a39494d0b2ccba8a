"""Pipeline parallelism over Ray: stage actors, micro-batches in flight, parity with the
in-process engine (real Ray, real SmolLM2 weights, float32)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from kvmesh.config import EngineConfig, SchedulerConfig
from scheduler.engine import AsyncEngine, LLMEngine
from scheduler.request import EngineError, SamplingParams
from workers.executor import RayPipelineExecutor, create_executor, ensure_ray, split_layers

KV = 64 * 2**20


@pytest.fixture(scope="module")
def ray_local():
    import ray
    ensure_ray(num_cpus=8)          # logical CPUs: room for every stage actor of this module
    yield
    ray.shutdown()


def _cfg(smollm2_dir, **kw):
    return EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=KV, max_model_len=512,
                        num_threads=1, **kw)


def _pipeline_engine(smollm2_dir, pp, pp_layers="", **kw):
    sc = SchedulerConfig(pp=pp, pp_layers=pp_layers, stage_num_cpus=1)
    return LLMEngine(_cfg(smollm2_dir, **kw), executor_factory=lambda c, d: create_executor(c, d, sc))


@pytest.fixture(scope="module")
def local_engine(smollm2_dir):
    return LLMEngine(_cfg(smollm2_dir))


@pytest.fixture(scope="module")
def pp2(ray_local, smollm2_dir):
    eng = _pipeline_engine(smollm2_dir, 2, max_num_batched_tokens=96)   # small budget: chunked prefills
    yield eng
    eng.shutdown()


def _requests(prose_ids, sp_for):
    # shared prefixes (prefix-cache hits), different lengths, one longer than the token budget
    return [(f"q{i}", prose_ids[: 40 + 37 * i] if i % 2 else prose_ids[5: 60 + 21 * i], sp_for(i)) for i in range(6)]


async def _stream_all(engine, requests, cancel_after: dict[str, int] | None = None):
    """Run every request concurrently through an AsyncEngine (micro-batches pipelined)."""
    ae = AsyncEngine(engine)
    cancel_after = cancel_after or {}

    async def one(rid, ids, sp):
        toks = []
        async for o in ae.generate(rid, ids, sp):
            toks += o.new_token_ids
            if rid in cancel_after and len(toks) >= cancel_after[rid]:
                break                                    # leaving the loop aborts the request
        return toks

    try:
        res = await asyncio.gather(*(one(*r) for r in requests))
    finally:
        await ae.shutdown()
    return {r[0]: toks for r, toks in zip(requests, res)}


def _offline(engine, h, requests):
    return {rid: r.output_token_ids for rid, r in h.run(engine, requests).items()}


def test_split_layers():
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(30, 2, [20, 10]) == [(0, 20), (20, 30)]
    for bad in ([10, 10], [30, 0], [15, 15, 0]):
        with pytest.raises(EngineError, match="pp_layers"):
            split_layers(30, 2, bad)
    with pytest.raises(EngineError, match="40 stages"):
        split_layers(30, 40)


def test_pp2_stages_hold_their_layers_and_share_the_block_pool(pp2, local_engine):
    ex = pp2.executor
    assert ex.layer_bounds == [(0, 15), (15, 30)] and ex.max_inflight == 2
    assert ex.num_blocks == local_engine.executor.num_blocks        # one budget, counted for all layers
    assert ex.kv_cache_bytes == local_engine.executor.kv_cache_bytes


async def test_pp2_greedy_streams_match_the_in_process_engine(pp2, local_engine, prose_ids, h):
    reqs = _requests(prose_ids, lambda i: h.greedy(8 + 3 * i))
    expected = _offline(local_engine, h, reqs)
    got = await _stream_all(pp2, [(f"g-{rid}", ids, sp) for rid, ids, sp in reqs])
    assert {k[2:]: v for k, v in got.items()} == expected
    assert pp2.stats().used == 0


async def test_pp2_seeded_sampling_and_penalties_match(pp2, local_engine, prose_ids, h):
    def sp(i):
        return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=100 + i, max_tokens=10, ignore_eos=True,
                              repetition_penalty=1.3 if i % 2 else 1.0, frequency_penalty=0.5 if i % 3 else 0.0,
                              logprobs=2 if i == 1 else None)
    reqs = _requests(prose_ids, sp)
    expected = _offline(local_engine, h, reqs)
    got = await _stream_all(pp2, [(f"s-{rid}", ids, p) for rid, ids, p in reqs])
    assert {k[2:]: v for k, v in got.items()} == expected


async def test_pp2_abort_mid_stream_frees_blocks_and_spares_the_others(pp2, local_engine, prose_ids, h):
    reqs = _requests(prose_ids, lambda i: h.greedy(12))
    expected = _offline(local_engine, h, reqs)
    got = await _stream_all(pp2, [(f"a-{rid}", ids, sp) for rid, ids, sp in reqs],
                            cancel_after={"a-q1": 2, "a-q4": 5})
    for rid, toks in got.items():
        want = expected[rid[2:]]
        assert toks == (want[: len(toks)] if rid in ("a-q1", "a-q4") else want)
    assert len(got["a-q1"]) < 12 and len(got["a-q4"]) < 12
    await asyncio.sleep(0.2)          # the engine thread has shut down; nothing may be held
    assert pp2.stats().used == 0 and not pp2.has_unfinished_requests()


def test_explicit_uneven_split_matches(ray_local, smollm2_dir, local_engine, prose_ids, h):
    eng = _pipeline_engine(smollm2_dir, 2, pp_layers="20,10")
    try:
        assert eng.executor.layer_bounds == [(0, 20), (20, 30)]
        reqs = _requests(prose_ids, lambda i: h.greedy(6))[:3]
        assert _offline(eng, h, reqs) == _offline(local_engine, h, reqs)
    finally:
        eng.shutdown()


def test_a_stage_that_cannot_load_is_an_engine_error(ray_local, smollm2_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(smollm2_dir / "config.json", broken / "config.json")      # config, but no weights
    cfg = EngineConfig(model=str(broken), dtype="float32", kv_cache_memory=KV, max_model_len=512)
    with pytest.raises(EngineError, match="pipeline stage failed to start.*no \\*.safetensors"):
        RayPipelineExecutor(cfg, str(broken), pp=2)
