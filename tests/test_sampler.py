"""Tests for workers/layers/sampler.py (no model needed, CPU, fast)."""

import math

import pytest
import torch

from kvmesh.core.sampling import SamplingParams
from workers.layers.sampler import (Sampler, SamplingMetadata, apply_penalties, make_generator)

V = 64
sampler = Sampler()


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
    torch.manual_seed(0)


def md_for(params, prompts=None, outputs=None, gens=None, vocab=V):
    B = len(params)
    return SamplingMetadata.build(params, prompts or [[] for _ in range(B)],
                                  outputs or [[] for _ in range(B)], gens or [None] * B,
                                  vocab, torch.device("cpu"))


def sample(logits, params, **kw):
    return sampler(logits, md_for(params, vocab=logits.shape[-1], **kw))


def log_dist(probs):
    """Logits whose softmax is exactly ``probs``."""
    return torch.tensor(probs, dtype=torch.float32).log()


def draws(logits_row, params, n):
    """n independent draws from one row (the row repeated n times in one batch)."""
    return sample(logits_row.expand(n, -1).clone(), [params] * n).token_ids


def test_greedy_is_argmax():
    logits = torch.randn(8, V)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_all_greedy_fast_path_uses_no_randomness():
    logits = torch.randn(8, V)
    md = md_for([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 8)
    assert md.all_greedy and md.no_penalties and md.no_top_k and md.no_top_p and md.no_min_p
    state = torch.get_rng_state()
    assert torch.equal(sampler(logits, md).token_ids, logits.argmax(-1))
    assert torch.equal(torch.get_rng_state(), state)  # no draw, no sort, nothing else
    # a mixed batch does draw, and its greedy rows are still argmax
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 4
    out = sample(logits, params)
    assert not torch.equal(torch.get_rng_state(), state)
    assert torch.equal(out.token_ids[0::2], logits.argmax(-1)[0::2])


def test_temperature_to_zero_is_greedy():
    logits = torch.stack([torch.randperm(V).float() for _ in range(16)])  # gaps >= 1
    for t in (1e-2, 1e-6):  # 1e-2 samples (the argmax has all but e^-100 of the mass); 1e-6 < eps is greedy
        out = sample(logits, [SamplingParams(temperature=t)] * 16)
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_1_is_greedy():
    logits = torch.randn(32, V)
    out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 32)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_p_keeps_smallest_nucleus():
    row = log_dist([0.04, 0.5, 0.06, 0.3, 0.1])  # sorted: 1 (.5), 3 (.3), 4 (.1), 2 (.06), 0 (.04)
    for top_p, nucleus in ((0.45, {1}), (0.75, {1, 3}), (0.85, {1, 3, 4}), (0.95, {1, 3, 4, 2})):
        seen = set(draws(row, SamplingParams(top_p=top_p), 4000).tolist())
        assert seen == nucleus, (top_p, seen)


def test_top_k_and_top_p_together():
    row = log_dist([0.04, 0.5, 0.06, 0.3, 0.1])
    # top_k=3 renormalises {1,3,4} to {.556,.333,.111}; top_p=0.85 then keeps {1,3}
    seen = set(draws(row, SamplingParams(top_k=3, top_p=0.85), 4000).tolist())
    assert seen == {1, 3}


def test_min_p_filters_relative_to_max():
    row = log_dist([0.04, 0.5, 0.06, 0.3, 0.1])
    # min_p=0.15 -> threshold 0.075: keep .5, .3, .1
    assert set(draws(row, SamplingParams(min_p=0.15), 4000).tolist()) == {1, 3, 4}
    assert set(draws(row, SamplingParams(min_p=0.0), 4000).tolist()) == {0, 1, 2, 3, 4}


def test_penalties_match_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams()]  # neutral row: untouched
    md = md_for(params, prompts=[[0, 1], [0, 1]], outputs=[[3, 3, 4, 3], [3]], vocab=6)
    out = apply_penalties(logits, md)
    # row 0: tokens 0,1 (prompt) repetition only; 3 (x3) and 4 (x1) repetition + presence + frequency
    expected0 = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 0.5 - 0.25 * 3, -2.0 * 2 - 0.5 - 0.25, 1.0]
    assert torch.allclose(out[0], torch.tensor(expected0))
    assert torch.equal(out[1], logits[1])
    # the sampler applies them before greedy argmax: 3 was the argmax, now 0 wins (1.0 > 0.75)
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5,
                             frequency_penalty=0.25)]
    assert sample(logits[:1], greedy, prompts=[[0, 1]], outputs=[[3, 3, 4, 3]]).token_ids.item() == 0


def test_presence_penalty_ignores_prompt_tokens():
    logits = torch.zeros(1, 4)
    md = md_for([SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)],
                prompts=[[0, 1]], outputs=[[2]], vocab=4)
    assert md.prompt_token_ids is None  # no repetition penalty: the prompt isn't even shipped
    assert torch.equal(apply_penalties(logits, md), torch.tensor([[0.0, 0.0, -2.0, 0.0]]))


def _seeded_run(seed, logits_row, index, others, steps=20):
    """Generate ``steps`` tokens for a seeded row placed at ``index`` among ``others``."""
    g = make_generator(seed, "cpu")
    target = SamplingParams(temperature=1.0, seed=seed)
    toks = []
    for _ in range(steps):
        params = list(others)
        params.insert(index, target)
        gens = [make_generator(1234 + i, "cpu") if p.seed is not None else None for i, p in enumerate(params)]
        gens[index] = g
        logits = torch.randn(len(params), logits_row.shape[-1])
        logits[index] = logits_row
        toks.append(sample(logits, params, gens=gens).token_ids[index].item())
    return toks


def test_same_seed_same_tokens_regardless_of_batch():
    row = torch.randn(V)
    alone = _seeded_run(7, row, 0, [SamplingParams(temperature=0.8)])
    crowded = _seeded_run(7, row, 3, [SamplingParams(temperature=1.3, top_k=5),
                                      SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.9, top_p=0.5, seed=3),
                                      SamplingParams(min_p=0.1)])
    assert alone == crowded
    assert len(set(alone)) > 3  # it really is sampling
    assert _seeded_run(8, row, 0, []) != alone


def test_empirical_distribution_matches_softmax():
    torch.manual_seed(1234)
    k, n = 8, 20000
    row = torch.randn(k)
    counts = torch.bincount(draws(row, SamplingParams(temperature=1.0), n), minlength=k)
    tv = 0.5 * (counts / n - row.softmax(-1)).abs().sum().item()
    # E[TV] <= 0.5*sqrt(k/n) (Cauchy-Schwarz on the multinomial s.d.) = 0.01; TV moves by at most
    # 1/n per draw, so McDiarmid gives P(TV > E[TV] + 0.02) <= exp(-2 n 0.02^2) = exp(-16).
    assert tv < 0.5 * math.sqrt(k / n) + 0.02, tv


def test_temperature_scales_distribution():
    torch.manual_seed(99)
    k, n, t = 6, 20000, 0.5
    row = torch.randn(k)
    counts = torch.bincount(draws(row, SamplingParams(temperature=t), n), minlength=k)
    tv = 0.5 * (counts / n - (row / t).softmax(-1)).abs().sum().item()
    assert tv < 0.5 * math.sqrt(k / n) + 0.02, tv


def test_logprobs_are_raw_log_softmax_and_include_sampled():
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.7, logprobs=5, repetition_penalty=1.5, top_k=10),
              SamplingParams(temperature=0.0, logprobs=2, presence_penalty=2.0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, logprobs=0)]
    outputs = [[int(logits[0].argmax())], [int(logits[1].argmax())], [], []]
    out = sample(logits, params, prompts=[[1, 2]] * 4, outputs=outputs)
    raw = logits.log_softmax(-1)
    for row, n in ((0, 5), (1, 2), (3, 0)):
        d, tok = out.logprobs[row], out.token_ids[row].item()
        top = set(raw[row].topk(n).indices.tolist()) if n else set()
        assert set(d) == top | {tok}
        for t, lp in d.items():
            assert lp == pytest.approx(raw[row, t].item(), abs=1e-6)
    assert out.logprobs[2] == {}
    # row 1 is greedy with a presence penalty on its argmax: it sampled something else
    assert out.token_ids[1].item() != logits[1].argmax().item()


def test_bf16_input():
    logits = torch.randn(6, V).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=0.5, top_k=3, logprobs=3)] * 2
    out = sample(logits, params)
    assert out.token_ids.shape == (6,) and out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids[0::3], logits.float().argmax(-1)[0::3])
    assert len(out.logprobs[2]) >= 3


def test_input_logits_not_modified():
    logits = torch.randn(3, V)
    before = logits.clone()
    sample(logits, [SamplingParams(repetition_penalty=1.3, temperature=0.5, top_k=4, min_p=0.2)] * 3,
           prompts=[[1, 2, 3]] * 3, outputs=[[4]] * 3)
    assert torch.equal(logits, before)
