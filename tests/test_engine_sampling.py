"""Sampling and stopping through the public API (``LLM.generate`` / ``LLM.chat`` on SmolLM2):
seeded reproducibility, stop strings, stop token ids, min_tokens, max_tokens, ignore_eos,
finish reasons, usage and logprobs. Seeded sampling under preemption and chunked prefill runs
on the tiny Llama.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvmesh.core.sampling import SamplingParams

EOS = 2   # SmolLM2's <|im_end|>
SKY = [{"role": "user", "content": "What color is the sky on a clear day? Answer with one word."}]
STORY = "Write the opening of a short story about a lighthouse keeper."


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    from kvmesh.llm import LLM
    return LLM(model=str(smollm2_dir), kv_cache_memory=96 * 2**20, max_model_len=512)


@pytest.fixture(scope="module")
def greedy_text(llm):
    """Greedy continuation of a plain-text prompt: (prompt, CompletionOutput)."""
    prompt = "The history of the printing press"
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert len(out.text) > 60 and len(out.token_ids) == 30
    return prompt, out


@pytest.fixture(scope="module")
def sky(llm):
    """Greedy chat answer that ends with EOS on its own."""
    out = llm.chat(SKY, SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] == EOS and EOS not in out.token_ids[:-1]
    assert 3 <= len(out.token_ids) < 30
    return out


# ---------------------------------------------------------------------------------------------
# seeds

def test_seeded_sampling_independent_of_batch(llm):
    prompt = llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": STORY}]),
                                  add_special_tokens=False)
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert len(alone) == 16
    others = [SamplingParams(temperature=0.9, max_tokens=8), SamplingParams(temperature=1.2, top_k=20, max_tokens=18),
              SamplingParams(temperature=0.0, max_tokens=6), SamplingParams(temperature=1.0, seed=99, max_tokens=16)]
    other_prompts = ["Tell me a joke.", "List three fruits:", [1, 2, 3], "Describe the sea in winter."]
    batch = llm.generate(other_prompts[:2] + [prompt] + other_prompts[2:], others[:2] + [sp] + others[2:])
    assert batch[2].outputs[0].token_ids == alone
    batch = llm.generate([prompt] + other_prompts, [sp] + others)     # other position, same seed
    assert batch[0].outputs[0].token_ids == alone
    # the seed matters: another seed gives another sample
    sp2 = SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], sp2)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("variant", ["preemption", "chunked"])
def test_seeded_sampling_survives_preemption_and_chunking(tiny_llama_dir, h, variant):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 20, 33, 47, 60, 18, 70, 9)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(8)]
    base = h.make_engine(tiny_llama_dir, enable_prefix_caching=False)
    alone = [h.run(base, [(f"alone-{variant}-{i}", p, sp)])[f"alone-{variant}-{i}"].output_token_ids
             for i, (p, sp) in enumerate(zip(prompts, params))]
    if variant == "preemption":
        eng = h.derive_engine(base, num_blocks=8)
    else:
        eng = h.derive_engine(base, max_num_batched_tokens=16)
    reqs = h.run(eng, [(f"{variant}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    if variant == "preemption":
        assert eng.scheduler.num_preemptions > 0
    assert [reqs[f"{variant}-{i}"].output_token_ids for i in range(8)] == alone


# ---------------------------------------------------------------------------------------------
# stop strings / stop token ids

def test_stop_string_cuts_output(llm, greedy_text):
    prompt, g = greedy_text
    stop = g.text[15:25]              # ten characters from the middle: spans several tokens
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert out.text == g.text[:g.text.index(stop)]
    assert stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == g.token_ids[:len(out.token_ids)] and len(out.token_ids) < 30


def test_earliest_stop_string_wins(llm, greedy_text):
    prompt, g = greedy_text
    late, early = g.text[40:46], g.text[12:17]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=[late, early]))[0].outputs[0]
    cut = min(g.text.index(late), g.text.index(early))
    assert out.text == g.text[:cut]
    assert out.stop_reason == (early if g.text.index(early) <= g.text.index(late) else late)


def test_stop_string_in_prompt_does_not_match(llm, greedy_text):
    prompt, g = greedy_text
    stop = "printing"
    assert stop in prompt
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    i = g.text.find(stop)
    assert out.text == (g.text if i < 0 else g.text[:i])


def test_stop_token_ids(llm, greedy_text):
    prompt, g = greedy_text
    k = next(i for i in range(4, 30) if g.token_ids[i] not in g.token_ids[:i])
    tok = g.token_ids[k]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == g.token_ids[:k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok


# ---------------------------------------------------------------------------------------------
# EOS, min_tokens, max_tokens, ignore_eos

def test_eos_stops(sky):
    assert sky.text.strip() and "<|im_end|>" not in sky.text


def test_max_tokens(llm, sky):
    n = len(sky.token_ids)
    out = llm.chat(SKY, SamplingParams(temperature=0.0, max_tokens=n - 2))[0].outputs[0]
    assert out.token_ids == sky.token_ids[:n - 2]
    assert out.finish_reason == "length" and out.stop_reason is None


def test_ignore_eos(llm, sky):
    n = len(sky.token_ids)
    out = llm.chat(SKY, SamplingParams(temperature=0.0, max_tokens=n + 6, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == n + 6 and out.finish_reason == "length"
    assert out.token_ids[:n] == sky.token_ids           # EOS generated, and generation went on


def test_min_tokens_does_not_stop_early(llm, sky):
    n = len(sky.token_ids)
    out = llm.chat(SKY, SamplingParams(temperature=0.0, max_tokens=n + 20, min_tokens=n + 6))[0].outputs[0]
    assert len(out.token_ids) >= n + 6


def test_min_tokens_suppresses_eos(llm, sky):
    """vLLM semantics: EOS (and stop_token_ids) cannot be sampled before min_tokens tokens."""
    n = len(sky.token_ids)
    out = llm.chat(SKY, SamplingParams(temperature=0.0, max_tokens=n + 6, min_tokens=n + 6))[0].outputs[0]
    assert EOS not in out.token_ids[:n + 6]
    assert len(out.token_ids) == n + 6 and out.finish_reason == "length"


def test_min_tokens_defers_stop_token_ids(llm, greedy_text):
    prompt, g = greedy_text
    k = next(i for i in range(4, 30) if g.token_ids[i] not in g.token_ids[:i])
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=30, min_tokens=k + 3,
                                              stop_token_ids=[g.token_ids[k]]))[0].outputs[0]
    assert len(out.token_ids) >= k + 3
    assert g.token_ids[k] not in out.token_ids[:k + 3]      # masked, not merely ignored


def test_min_tokens_with_stop_token_ids_outside_the_vocabulary(llm, greedy_text):
    """Stop token ids past the vocabulary (a client may send any uint32) are allowed and never
    match; under min_tokens they are skipped, not used as logit indexes (found by
    tests/test_fuzz_api.py: it killed the engine loop, IndexError)."""
    prompt, g = greedy_text
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, ignore_eos=True,
                                              stop_token_ids=[2**32 - 1, 60000]))[0].outputs[0]
    assert out.token_ids == g.token_ids[:4]                  # served, the greedy tokens
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, min_tokens=3, ignore_eos=True,
                                              stop_token_ids=[2**32 - 1, g.token_ids[1]]))[0].outputs[0]
    assert g.token_ids[1] not in out.token_ids[:3]           # the id in the vocabulary still masked


# ---------------------------------------------------------------------------------------------
# usage, finish reasons, logprobs

def test_usage_and_finish_reasons(llm):
    prompts = ["Hello there", "The quick brown fox", "1, 2, 3, 4,"]
    params = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=1, max_tokens=9, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        assert o.finished and o.prompt == p
        assert o.prompt_token_ids == llm.tokenizer.encode(p)
        c = o.outputs[0]
        assert len(c.token_ids) == sp.max_tokens and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_engine_output_counts(llm):
    eng = llm.engine
    ids = llm.tokenizer.encode("Counting tokens is easy:")
    eng.add_request("count", ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == "count"]
    assert [len(o.new_token_ids) for o in outs] == [1] * 6
    last = outs[-1]
    assert last.finished and last.finish_reason.value == "length"
    assert last.num_prompt_tokens == len(ids) and last.num_output_tokens == 6
    assert not any(o.finished for o in outs[:-1])


def test_logprobs(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())
        assert lp[tok] == max(lp.values())                # greedy: the sampled token is the top one
        assert sum(math.exp(v) for v in lp.values()) <= 1 + 1e-5
    assert llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].logprobs is None


def test_reset_prefix_cache_makes_the_next_prompt_a_miss(llm):
    """LLM.reset_prefix_cache (vLLM's API): a prompt repeated after it is prefilled from scratch,
    with the same greedy text; repeated without it, the prompt's full blocks are cache hits."""
    prompt = "Employees may carry over at most five days of annual leave into the next calendar year. " * 4
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompt, sp)[0]
    again = llm.generate(prompt, sp)[0]
    assert again.metrics.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.engine.stats().cached == 0
    after = llm.generate(prompt, sp)[0]
    assert after.metrics.num_cached_tokens == 0
    assert after.outputs[0].token_ids == again.outputs[0].token_ids == first.outputs[0].token_ids
