"""AsyncLLM (streaming on a background engine thread) on SmolLM2: multibyte text streams
intact, stop strings never leak into deltas, leaving the iteration aborts the request, and
aborts racing with running steps do not break the engine loop."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import pytest_asyncio

from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

KOREAN = ("User: Say hello in Korean with an emoji.\nAssistant: 안녕하세요! 🎉😊\n"
          "User: Say it again.\nAssistant:")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def allm(smollm2_dir):
    from kvmesh.llm import AsyncLLM
    llm = AsyncLLM(model=str(smollm2_dir), kv_cache_memory=96 * 2**20, max_model_len=512)
    yield llm
    await llm.shutdown()


async def _collect(allm, prompt, params, request_id=None):
    updates = []
    async for ro in allm.generate(request_id, prompt, params):
        updates.append(ro)
    return updates


async def _wait_idle(allm, timeout=10.0):
    eng = allm.engine.engine
    for _ in range(int(timeout / 0.02)):
        if not eng.has_unfinished_requests():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("engine did not become idle")


def _is_hangul(c):
    return "\uac00" <= c <= "\ud7a3"


async def test_multibyte_characters_stream_intact(allm):
    ups = await _collect(allm, KOREAN, SamplingParams(temperature=0.0, max_tokens=40, stop=["\n"]))
    final = ups[-1].outputs[0]
    deltas = [u.outputs[0].delta_text for u in ups]
    assert final.finish_reason == "stop" and final.stop_reason == "\n"
    assert "".join(deltas) == final.text
    assert all("\ufffd" not in d for d in deltas)
    # the test means something: Korean and an emoji came out, each spread over several tokens,
    # so some steps produced a token but no text (an incomplete character held back)
    assert any(_is_hangul(c) for c in final.text) and any(ord(c) >= 0x1F300 for c in final.text)
    assert len(final.token_ids) > len(final.text.strip())
    assert any(u.outputs[0].delta_token_ids and not u.outputs[0].delta_text for u in ups)
    assert sum(1 for d in deltas if d) > 3
    tok = allm.tokenizer
    assert tok.decode(final.token_ids, skip_special_tokens=True).startswith(final.text)


async def test_stop_string_never_streamed(allm):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = (await _collect(allm, "The history of the printing press", params))[-1].outputs[0].text
    stop = full[20:27]
    ups = await _collect(allm, "The history of the printing press",
                         SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))
    deltas = [u.outputs[0].delta_text for u in ups]
    text = ups[-1].outputs[0].text
    assert text == full[:full.index(stop)] == "".join(deltas)
    assert ups[-1].outputs[0].finish_reason == "stop"
    for u in ups:            # no cumulative text ever showed the stop string (or any part past the cut)
        assert full.startswith(u.outputs[0].text) and len(u.outputs[0].text) <= len(text)
    await _wait_idle(allm)
    assert allm.engine.engine.stats().used == 0


async def test_breaking_out_aborts_the_request(allm):
    eng = allm.engine.engine
    n = 0
    async for ro in allm.generate("brk", "Write a long essay about the ocean.",
                                  SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)):
        if n == 0:
            eid = allm.engine.engine_id("brk")          # the engine's id of this submission
            req = eng.scheduler.requests[eid]
        n += 1
        if n == 3:
            break
    await _wait_idle(allm)
    assert req.is_finished and req.finish_reason.value == "abort"
    assert len(req.output_token_ids) < 50
    assert eid not in eng.scheduler.requests and allm.engine.engine_id("brk") is None
    assert eng.stats().used == 0


def _engine_request(allm, request_id: str):
    """The engine's Request of the open stream ``request_id`` (None before it is added)."""
    return allm.engine.engine.scheduler.requests.get(allm.engine.engine_id(request_id))


async def test_abort_from_another_task(allm):
    async def consume():
        return await _collect(allm, "Count from one to one hundred:",
                              SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True), "ab1")
    task = asyncio.create_task(consume())
    while not getattr(_engine_request(allm, "ab1"), "output_token_ids", None):
        await asyncio.sleep(0.01)
    assert allm.abort("ab1")
    ups = await asyncio.wait_for(task, 30)
    assert ups[-1].finished and ups[-1].outputs[0].finish_reason == "abort"
    assert len(ups[-1].outputs[0].token_ids) < 300
    await _wait_idle(allm)
    assert allm.engine.engine.stats().used == 0


async def test_concurrent_streams_match_sequential(allm):
    prompts = ["The sun", "Paris is", "In 1905, Einstein", "Water boils at"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seq = [(await _collect(allm, p, params))[-1].outputs[0].token_ids for p in prompts]
    conc = await asyncio.gather(*(_collect(allm, p, params) for p in prompts))
    assert [c[-1].outputs[0].token_ids for c in conc] == seq
    for c in conc:
        assert sum(len(u.outputs[0].delta_token_ids) for u in c) == 8


async def test_bad_requests_keep_the_loop_alive(allm):
    with pytest.raises(EngineError, match="prompt is empty"):
        await _collect(allm, "", SamplingParams())
    with pytest.raises(EngineError, match="outside the vocabulary"):
        await _collect(allm, [1, 49152], SamplingParams())

    async def slow():
        return await _collect(allm, "Tell me about cats.", SamplingParams(temperature=0.0, max_tokens=20), "dup-a")
    task = asyncio.create_task(slow())
    while _engine_request(allm, "dup-a") is None:
        await asyncio.sleep(0.005)
    with pytest.raises(EngineError, match="duplicate request id 'dup-a'"):
        await _collect(allm, "Hi", SamplingParams(max_tokens=2), "dup-a")
    ups = await task
    assert ups[-1].finished and len(ups[-1].outputs[0].token_ids) >= 1
    ok = await _collect(allm, "Hello", SamplingParams(temperature=0.0, max_tokens=3))
    assert ok[-1].finished and allm.engine.errored is None


async def test_aborts_racing_with_steps(allm, wrap_executor):
    """Many streams cut at different points while others keep running: aborts land while the
    engine thread is inside a step. The loop must survive and the blocks come back."""
    import time
    eng = allm.engine.engine
    inner = eng.executor
    # each step waits a little before it runs, as a remote (pipeline) executor does while it ships
    # the batch: widens the window in which an abort from the event loop meets a step that has
    # been scheduled but whose block tables are not read yet
    eng.executor = wrap_executor(inner, before_step=lambda n: time.sleep(0.03))
    try:
        await _race(allm)
    finally:
        eng.executor = inner


async def _race(allm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def cut(i):
        k = 0
        async for _ in allm.generate(f"race-{i}", f"Story number {i}: once upon a time", params):
            k += 1
            if k == 1 + i % 4:
                break

    keep = asyncio.create_task(_collect(allm, "A list of rivers:", SamplingParams(temperature=0.0, max_tokens=30,
                                                                                 ignore_eos=True)))
    await asyncio.gather(*(cut(i) for i in range(12)))
    ups = await asyncio.wait_for(keep, 30)
    assert allm.engine.errored is None
    assert len(ups[-1].outputs[0].token_ids) == 30
    await _wait_idle(allm)
    eng = allm.engine.engine
    assert eng.stats().used == 0 and not eng.scheduler.requests


async def test_engine_loop_failure_reaches_callers(tiny_llama_dir, h, wrap_executor):
    """If a step raises, every open stream gets an EngineError (instead of waiting forever)
    and new requests are refused."""
    from scheduler.async_engine import AsyncEngine
    from scheduler.engine import LLMEngine
    base = h.make_engine(tiny_llama_dir)

    def fail_third(n):
        if n == 3:
            raise RuntimeError("device lost")

    eng = AsyncEngine(LLMEngine(base.cfg, executor=wrap_executor(base.executor, before_step=fail_third)))
    try:
        async def stream(rid):
            return [o async for o in eng.generate(rid, [1, 2, 3, 4], h.greedy(20))]
        results = await asyncio.wait_for(asyncio.gather(stream("f1"), stream("f2"), return_exceptions=True), 20)
        for r in results:
            assert isinstance(r, EngineError) and "engine loop died" in str(r) and "device lost" in str(r)
        with pytest.raises(EngineError, match="engine loop died"):
            eng.add_request("f3", [1, 2], h.greedy(2))
    finally:
        await eng.shutdown()


async def test_an_id_is_free_once_its_stream_ends(allm):
    """Break out of a stream (its abort waits for the step in progress) and reuse its id at
    once, five times: each reuse is served in full, never refused as a duplicate nor ended by
    the previous request's abort."""
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for _ in range(5):
        async with contextlib.aclosing(allm.generate("again", "Write a long essay about the ocean.", sp)) as stream:
            async for _ro in stream:
                break
        ups = await _collect(allm, "Hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), "again")
        assert ups[-1].outputs[0].finish_reason == "length" and len(ups[-1].outputs[0].token_ids) == 3
    await _wait_idle(allm)
    assert allm.engine.engine.stats().used == 0
