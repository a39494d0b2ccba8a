"""Pipeline parallelism over Ray: stage actors, micro-batches in flight, parity with the
in-process engine (real Ray, real SmolLM2 weights, float32), and the incremental step messages
the stages get (workers/step.py): pickled and decoded as a stage decodes them, they rebuild
exactly the sequences the scheduler holds under chunked prefill, preemption, penalties, static
batching's padding rows and speculative decoding."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil

import pytest

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from kvmesh.core.service_config import SchedulerConfig
from scheduler.async_engine import AsyncEngine
from scheduler.engine import LLMEngine
from workers.executor import RayPipelineExecutor, create_executor, ensure_ray, split_layers
from workers.step import NewRequest, SeqDelta, SeqInput, StepDecoder, StepDelta, StepEncoder

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


def test_pp2_stages_of_a_local_ray_run_at_this_process_priority(pp2):
    """Not at Ray's default worker niceness (15), under which any process at normal priority
    takes the stages' CPU first (seen: replica restarts 3-5x slower beside 2 busy processes)."""
    import ray
    infos = ray.get([s.info.remote() for s in pp2.executor.stages])
    assert [i["nice"] for i in infos] == [os.getpriority(os.PRIO_PROCESS, 0)] * 2
    assert all(i["pid"] != os.getpid() for i in infos)


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


# ---------------------------------------------------------------------------------------------
# incremental step messages

def _scheduler_view(out, block_size: int) -> list[SeqInput]:
    """The sequences of scheduler output ``out`` built from the scheduler's own requests: each
    one's tokens, the block table covering its slots (verified proposals and the draft's
    lookahead included), its prompt and, when it samples, its sampling state and output."""
    seqs = []
    for s in out.seqs:
        req, end = s.req, s.start + s.num_new_tokens
        slots = end + len(s.spec_token_ids) + (1 + s.num_proposals if s.num_proposals else 0)
        seq = SeqInput(req.request_id, s.start, req.tokens(s.start, end), req.block_table[: -(-slots // block_size)],
                       s.sample, traceparent=req.traceparent, spec_token_ids=list(s.spec_token_ids),
                       num_proposals=s.num_proposals, prompt_token_ids=req.prompt_token_ids)
        if s.sample:
            seq.params, seq.num_output_tokens = req.sampling_params, req.num_output_tokens
            seq.eos_token_ids, seq.output_token_ids = req.eos_token_ids, req.output_token_ids
        seqs.append(seq)
    return seqs


class _StepMessages:
    """An observer (conftest.WrappedExecutor) that sends each step as RayPipelineExecutor sends
    it: encoded, pickled and decoded as a stage decodes it (the last stage: it records the
    sampled tokens). The decoded sequences must equal the scheduler's view of the step
    (:func:`_scheduler_view`); its pickle is the size a full step would have."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.encoder, self.decoder = StepEncoder(block_size), StepDecoder()
        self.sizes: list[tuple[int, int, bool]] = []     # (message bytes, full StepInput bytes, plain decodes)
        self._done: list[int] = []

    def step(self, out):
        full = _scheduler_view(out, self.block_size)
        raw = pickle.dumps(self.encoder.encode(out))
        delta = pickle.loads(raw)
        assert self.decoder.apply(delta).seqs == full
        self._done = delta.done
        plain = all(s.num_scheduled_tokens == 1 and not s.padding for s in out.seqs)   # (padding rows: sent anew)
        self.sizes.append((len(raw), len(pickle.dumps(full)), plain))

    def stepped(self, out, result):
        self.decoder.record(result.sampled)
        self.decoder.free(self._done)

    def free(self, ids):
        self.decoder.free(self.encoder.free(ids))


def _mix(prose_ids, h):
    """Greedy, seeded with repetition penalty, presence/frequency penalties, min_tokens,
    logprobs; prompts of 40-150 tokens (10 blocks at most: a 12-block pool preempts)."""
    return [("g", prose_ids[:70], h.greedy(10)),
            ("rep", prose_ids[10:120], SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, max_tokens=10,
                                                      ignore_eos=True)),
            ("pen", prose_ids[50:90], h.greedy(10, frequency_penalty=0.6, presence_penalty=0.3)),
            ("min", prose_ids[5:45], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6)),
            ("lp", prose_ids[30:180], h.greedy(6, logprobs=2)),
            ("long", prose_ids[:150], h.greedy(8))]


@pytest.fixture(scope="module")
def scratch_engine(smollm2_dir):
    """An in-process engine whose KV blocks other engines overwrite (not local_engine: its
    prefix cache would then serve blocks holding other K/V)."""
    return LLMEngine(_cfg(smollm2_dir))


@pytest.mark.parametrize("variant", ["preemption", "static", "ngram"])
def test_step_messages_rebuild_the_full_step_input(scratch_engine, prose_ids, h, wrap_executor, variant):
    reqs = _mix(prose_ids, h)
    if variant == "preemption":      # a 12-block pool and 64-token chunks: preempted and recomputed
        kw, num_blocks = dict(max_num_batched_tokens=64), 12
    elif variant == "static":        # finished rows stay in the batch (padding) after their free
        kw, num_blocks = dict(policy="static", max_num_seqs=4), None
    else:                            # proposals verified, rejected ones rolled back (blocks trimmed); uncapped:
        # the three requests speculate together (the default cap stops speculation from three on)
        kw, num_blocks = dict(speculative_method="ngram", num_speculative_tokens=4, speculative_max_batch_tokens=0), None
        reqs = [("copy", prose_ids[:80] + prose_ids[:30], h.greedy(24)), ("plain", prose_ids[100:150], h.greedy(12)),
                ("seeded", prose_ids[:60] + prose_ids[:20], SamplingParams(temperature=0.8, seed=7, max_tokens=16,
                                                                            ignore_eos=True))]
    ex = _StepMessages(scratch_engine.cfg.block_size)
    eng = LLMEngine(scratch_engine.cfg.replace(**kw), executor=wrap_executor(scratch_engine.executor, num_blocks,
                                                                             observer=ex))
    out = h.run(eng, reqs)
    if variant == "preemption":
        assert eng.scheduler.num_preemptions > 0
    if variant == "ngram":
        assert out["copy"].num_draft_tokens > out["copy"].num_accepted_tokens > 0    # accepted and rejected
        assert out["seeded"].num_draft_tokens > 0
    assert len(ex.encoder) == 0 and not ex.decoder.states          # every request forgotten on both sides
    decodes = [(m, f) for m, f, d in ex.sizes if d]
    assert decodes and all(m * 4 < f for m, f in decodes)           # decode steps: under a quarter of the bytes


async def test_pp2_preemption_and_static_padding_match_and_free_every_request(pp2, local_engine, prose_ids, h,
                                                                              wrap_executor):
    import ray
    reqs = _mix(prose_ids, h)
    expected = _offline(local_engine, h, reqs)
    try:
        small = LLMEngine(pp2.cfg.replace(max_num_batched_tokens=64), executor=wrap_executor(pp2.executor, 12))
        got = await _stream_all(small, [(f"p-{rid}", ids, sp) for rid, ids, sp in reqs])
        assert small.scheduler.num_preemptions > 0
        assert {k[2:]: v for k, v in got.items()} == expected
        static = LLMEngine(pp2.cfg.replace(policy="static", max_num_seqs=4),
                           executor=wrap_executor(pp2.executor))
        got = await _stream_all(static, [(f"t-{rid}", ids, sp) for rid, ids, sp in reqs])
        assert {k[2:]: v for k, v in got.items()} == expected
    finally:
        pp2.block_manager.reset_prefix_cache()    # its cached blocks now hold these engines' K/V
    assert len(pp2.executor.encoder) == 0
    assert [i["num_requests"] for i in ray.get([s.info.remote() for s in pp2.executor.stages])] == [0, 0]


def test_pp2_a_step_failing_on_one_stage_fails_the_next_and_keeps_the_link_in_step(pp2, local_engine, prose_ids, h):
    """Stage 0 fails a step (a message for a request it does not hold) that stage 1 could run:
    stage 1 gets the error frame instead of hidden states and fails it too; the next step
    runs on both as if nothing happened (no frame left behind on the link)."""
    import ray
    from ray.exceptions import RayTaskError

    prompt = prose_ids[:20]
    want = _offline(local_engine, h, [("link", prompt, h.greedy(2))])["link"]
    s0, s1 = pp2.executor.stages
    hd, sp = 10**6, h.greedy(2)                   # a handle the executor's encoder never gives out
    try:
        first = StepDelta([NewRequest(hd, "link-test", sp, (), 0, prompt, [], None)],
                          [SeqDelta(hd, 0, prompt, True, (0, 0, 1))], [])
        refs = [s.execute.remote(first) for s in (s0, s1)]
        assert ray.get(refs[1]).sampled == {"link-test": want[:1]}
        decode = StepDelta([], [SeqDelta(hd, 20, want[:1], True, ())], [])
        refs = [s0.execute.remote(StepDelta([], [SeqDelta(hd + 1, 20, want[:1], True, ())], [])),
                s1.execute.remote(decode)]
        with pytest.raises(RayTaskError, match=f"stage 0: step for request handle {hd + 1}"):
            ray.get(refs[1])
        refs = [s.execute.remote(decode) for s in (s0, s1)]
        assert ray.get(refs[1]).sampled == {"link-test": want[1:2]}
    finally:
        ray.get([s.free_requests.remote([hd]) for s in (s0, s1)])
        pp2.block_manager.reset_prefix_cache()    # blocks 0 and 1 now hold this test's K/V


def test_a_local_ray_start_that_times_out_is_started_again(monkeypatch, capsys):
    """ensure_ray stops and starts again a local instance whose raylet did not register in
    Ray's 30 s (a busy 2-core machine), up to LOCAL_RAY_STARTS starts; any other error, or the
    last timeout, is raised as it comes. Ray's init and shutdown are recorded here, not run."""
    import ray

    from workers import executor

    timeout = Exception("The current node timed out during startup. This could happen because ...")
    calls: list[str] = []

    def init(*, fail_with: list, **kw):
        calls.append("init")
        if fail_with:
            raise fail_with.pop(0)

    def run(fail_with: list):
        calls.clear()
        monkeypatch.setattr(ray, "init", lambda **kw: init(fail_with=fail_with, **kw))
        executor.ensure_ray(num_cpus=1)
        return list(calls)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    assert run([timeout, timeout]) == ["init", "shutdown", "init", "shutdown", "init"]
    assert capsys.readouterr().err.count("timed out during startup (start") == 2
    with pytest.raises(Exception, match="timed out during startup"):
        run([timeout] * executor.LOCAL_RAY_STARTS)
    assert calls.count("init") == executor.LOCAL_RAY_STARTS
    with pytest.raises(RuntimeError, match="no room"):
        run([RuntimeError("no room")])
    assert calls == ["init"]
