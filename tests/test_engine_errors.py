"""Bad input: each case raises EngineError naming the problem, and the engine keeps serving.

After every rejected request a normal request runs and must give exactly the output it gave
before any error, with no request or KV block left behind.
"""

from __future__ import annotations

import pytest

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams

SMOL_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4     # layers x block x kv heads x head dim x fp32, K and V


# ---------------------------------------------------------------------------------------------
# text API (LLM on SmolLM2): KV pool of 8 blocks (128 tokens), max_model_len 256

@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from kvmesh.llm import LLM
    llm = LLM(model=str(smollm2_dir), kv_cache_memory=8 * SMOL_BLOCK_BYTES, max_model_len=256)
    assert llm.engine.executor.num_blocks == 8
    return llm


@pytest.fixture(scope="module")
def check_serving(llm):
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0.0, max_tokens=6)
    expected = llm.generate(prompt, params)[0].outputs[0]
    assert expected.token_ids

    def check():
        eng = llm.engine
        assert not eng.has_unfinished_requests() and not eng.scheduler.requests
        assert eng.stats().used == 0
        out = llm.generate(prompt, params)[0].outputs[0]
        assert (out.token_ids, out.text) == (expected.token_ids, expected.text)
    return check


def _raises(match, fn, *a, **kw):
    with pytest.raises(EngineError, match=match):
        fn(*a, **kw)


def test_empty_prompt(llm, check_serving):
    _raises("prompt is empty", llm.generate, "")
    check_serving()
    _raises("prompt is empty", llm.generate, [[]])
    check_serving()
    _raises("prompt is empty", llm.engine.add_request, None, [])
    check_serving()


def test_prompt_longer_than_max_model_len(llm, check_serving):
    long_prompt = "word " * 400
    assert len(llm.tokenizer.encode(long_prompt)) > 256
    _raises(r"exceeds max_model_len 256", llm.generate, long_prompt)
    check_serving()
    # prompt fits, but prompt + max_tokens does not
    _raises(r"max_tokens \(40\).*exceeds max_model_len 256", llm.generate, [[5] * 220],
            SamplingParams(max_tokens=40))
    check_serving()


def test_request_larger_than_kv_pool(llm, check_serving):
    # 150 + 50 = 200 tokens <= max_model_len, but 13 blocks > the 8-block pool
    _raises(r"needs 13 KV blocks .* whole pool has 8", llm.generate, [[7] * 150], SamplingParams(max_tokens=50))
    check_serving()


def test_max_tokens_zero(llm, check_serving):
    _raises("max_tokens must be >= 1", SamplingParams, max_tokens=0)
    sp = SamplingParams(temperature=0.0)
    sp.max_tokens = 0                       # mutated after construction: add_request re-validates
    _raises("max_tokens must be >= 1", llm.generate, "Hello", sp)
    check_serving()


def test_negative_temperature(llm, check_serving):
    _raises("temperature must be >= 0", SamplingParams, temperature=-0.5)
    sp = SamplingParams()
    sp.temperature = -1.0
    _raises("temperature must be >= 0", llm.generate, "Hello", sp)
    check_serving()


@pytest.mark.parametrize("bad", [49152, 10**9, -1])
def test_token_id_outside_vocabulary(llm, check_serving, bad):
    _raises(rf"token id {bad} is outside the vocabulary \[0, 49152\)", llm.generate, [[1, 2, bad, 3]])
    check_serving()


def test_bad_request_in_a_batch_rejects_it_before_anything_runs(llm, check_serving):
    good = "Once upon a time"
    _raises("outside the vocabulary", llm.generate, [good, [1, 2, 10**6], good])
    check_serving()


def test_duplicate_request_id(llm, check_serving):
    eng = llm.engine
    ids = llm.tokenizer.encode("The capital of France is")
    first = eng.add_request("dup", ids, SamplingParams(temperature=0.0, max_tokens=6))
    _raises("duplicate request id 'dup'", eng.add_request, "dup", ids, SamplingParams(max_tokens=3))
    while eng.has_unfinished_requests():
        eng.step()
    assert first.is_finished and len(first.output_token_ids) == 6
    check_serving()
    # a finished request's id may be used again
    again = eng.add_request("dup", ids, SamplingParams(temperature=0.0, max_tokens=6))
    while eng.has_unfinished_requests():
        eng.step()
    assert again.output_token_ids == first.output_token_ids
    check_serving()


def test_unknown_model_name():
    from kvmesh.llm import LLM
    from kvmesh.hub.pull import resolve_model
    _raises("unknown model 'no-such-model'", resolve_model, "no-such-model")
    _raises("unknown model 'no-such-model'", LLM, model="no-such-model")


def test_directory_without_checkpoint(tmp_path):
    from kvmesh.llm import LLM
    _raises("no config.json", LLM, model=str(tmp_path))


# ---------------------------------------------------------------------------------------------
# engine settings (tiny model)

@pytest.mark.parametrize("kw, match", [
    (dict(policy="fifo"), "unknown scheduling policy 'fifo'"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(dtype="int8"), "unknown dtype 'int8'"),
    (dict(max_model_len=100_000), "max_model_len 100000 exceeds the model's max_position_embeddings 512"),
    (dict(max_num_seqs=0), "max_num_seqs and max_num_batched_tokens must be >= 1"),
])
def test_bad_engine_settings(tiny_llama_dir, h, kw, match):
    from scheduler.engine import LLMEngine
    with pytest.raises(EngineError, match=match):
        LLMEngine(EngineConfig(model=str(tiny_llama_dir), **kw))


def test_prompt_over_token_budget_without_chunked_prefill(tiny_llama_dir, h):
    """With chunked prefill off a prompt must fit the step's token budget in one piece; a
    longer one can never be scheduled, so it is rejected up front instead of hanging."""
    eng = h.make_engine(tiny_llama_dir, max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(EngineError, match="max_num_batched_tokens"):
        eng.add_request("too-big", list(range(40)), h.greedy(4))
    assert not eng.has_unfinished_requests()
    # what fits is served, and outputs match an engine with chunking
    ok = h.run(eng, [("fits", list(range(20)), h.greedy(4))], max_steps=50)["fits"]
    ref = h.make_engine(tiny_llama_dir)
    assert ok.output_token_ids == h.run(ref, [("fits", list(range(20)), h.greedy(4))])["fits"].output_token_ids
