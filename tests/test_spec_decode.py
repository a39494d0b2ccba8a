"""Speculative decoding (docs/spec_decode.md): prompt-lookup and draft-model proposals,
greedy and rejection-sampling verification, rollback, stops inside accepted runs, the token
budget, pipeline parallelism and the acceptance metrics (real SmolLM2 weights, float32).

Exactness of the rejection sampler is checked on synthetic distributions with fixed seeds:
chi-square statistics against the 0.999 quantile of their chi-square distribution (df=5:
20.52, df=35: 66.62), so the tests are deterministic and would fail for a sampler off by a
few percent of probability mass on any token."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import SchedulerConfig
from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from scheduler.async_engine import AsyncEngine
from scheduler.batching import make_scheduler
from scheduler.block_manager import BlockManager
from scheduler.engine import LLMEngine
from scheduler.request import FinishReason, Request
from scheduler.scheduler import Scheduler
from workers.spec_decode.ngram import propose_ngram
from workers.spec_decode.rejection import VerifyRow, verify

CHI2_999 = {5: 20.52, 35: 66.62}


# ---------------------------------------------------------------------------------------------
# prompt lookup

def test_propose_ngram_longest_most_recent_match():
    # last 3 tokens [1, 2, 3] occur at 0 and 5; the most recent earlier one (5) wins
    seq = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram(seq, 2, 3, 2) == [7, 8]
    assert propose_ngram(seq, 10, 3, 2) == [7, 8, 5, 1, 2, 3]     # up to the end of the sequence
    # n=3 does not match ([4, 2, 3] is new), n=2 ([2, 3]) does
    assert propose_ngram([2, 3, 6, 4, 2, 3], 3, 3, 2) == [6, 4, 2]
    assert propose_ngram([2, 3, 6, 4, 2, 3], 3, 3, 3) == []       # n_min too long
    assert propose_ngram([5, 6, 7], 4, 3, 1) == []                # nothing repeats
    assert propose_ngram([5, 6, 5], 4, 3, 1) == [6, 5]            # n=1
    assert propose_ngram([5, 6, 5], 0, 3, 1) == []


# ---------------------------------------------------------------------------------------------
# rejection sampler on synthetic distributions

V = 6


def _dist(g, sharp=1.0):
    return torch.softmax(sharp * torch.randn(V, generator=g), dim=-1)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    assert expected.min() >= 5, "too few samples for a chi-square test"
    return float(((counts - expected) ** 2 / expected).sum())


def _run_two_tokens(n: int, point_mass: bool, seed: int):
    """n independent rows of k=2 proposals: x1 ~ q0, x2 ~ Q1[x1] (or fixed tokens for a point
    mass); target p0, P1[t1], bonus pb. A row that emits one token gets its second from the
    next step, a plain sample from P1[t1]. Returns the joint counts of (t1, t2), the expected
    joint, the first-token counts and p0."""
    g = torch.Generator().manual_seed(seed)
    p0, pb = _dist(g), _dist(g)
    P1 = torch.stack([_dist(g) for _ in range(V)])
    q0 = _dist(g, 2.0)
    Q1 = torch.stack([_dist(g, 2.0) for _ in range(V)])
    torch.manual_seed(seed)
    if point_mass:
        x1, x2 = torch.full((n,), 2), torch.full((n,), 4)
        rows = [VerifyRow([2, 4], None, greedy=False) for _ in range(n)]
    else:
        x1 = torch.multinomial(q0, n, replacement=True, generator=g)
        x2 = torch.multinomial(Q1[x1], 1, generator=g).squeeze(1)
        q = torch.stack([q0.expand(n, V), Q1[x1]], dim=1)                       # [n, 2, V]
        rows = [VerifyRow([a, b], q[i], greedy=False) for i, (a, b) in enumerate(zip(x1.tolist(), x2.tolist()))]
    target = torch.stack([p0.expand(n, V), P1[x1], pb.expand(n, V)], dim=1).reshape(3 * n, V)
    out = verify(rows, target.argmax(-1), target)
    t1 = torch.tensor([t[0] for t in out])
    nxt = torch.multinomial(P1[t1], 1, generator=g).squeeze(1).tolist()     # the next step's token
    t2 = torch.tensor([t[1] if len(t) > 1 else nx for t, nx in zip(out, nxt)])
    joint = torch.bincount(t1 * V + t2, minlength=V * V).float().view(V, V)
    first = torch.bincount(t1, minlength=V).float()
    return joint, p0[:, None] * P1, first, p0, out


@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-probs", "point-mass"])
def test_rejection_sampling_matches_target_distribution(point_mass):
    joint, expected, first, p0, out = _run_two_tokens(20_000, point_mass, seed=7)
    assert _chi2(first, p0) < CHI2_999[5]
    assert _chi2(joint.flatten(), expected.flatten()) < CHI2_999[35]
    # both branches ran: rejections at the first token, and rows accepting both proposals
    lengths = [len(t) for t in out]
    assert min(lengths) == 1 and max(lengths) == 3


def test_rejection_all_accepted_bonus_and_point_mass_zero():
    g = torch.Generator().manual_seed(3)
    p0, p1, pb = _dist(g), _dist(g), _dist(g)
    n = 20_000
    # the draft equals the target: every proposal is accepted, the bonus token comes from pb
    x1 = torch.multinomial(p0, n, replacement=True, generator=g).tolist()
    x2 = torch.multinomial(p1, n, replacement=True, generator=g).tolist()
    q = torch.stack([p0, p1])
    rows = [VerifyRow([a, b], q, greedy=False) for a, b in zip(x1, x2)]
    target = torch.stack([p0, p1, pb]).repeat(n, 1)
    out = verify(rows, target.argmax(-1), target)
    assert all(len(t) == 3 for t in out)
    bonus = torch.bincount(torch.tensor([t[2] for t in out]), minlength=V).float()
    assert _chi2(bonus, pb) < CHI2_999[5]
    # a proposal the target gives probability 0 is never accepted
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    out = verify([VerifyRow([3], None, greedy=False) for _ in range(200)],
                 torch.zeros(400, dtype=torch.long), p.repeat(400, 1))
    assert all(len(t) == 1 and t[0] in (0, 1) for t in out)


def test_rejection_greedy_and_seeded_rows():
    # greedy: longest prefix matching the argmax, then the argmax
    argmax = torch.tensor([4, 5, 9, 1, 7, 8, 3])
    out = verify([VerifyRow([4, 5, 6]), VerifyRow([7, 8])], argmax, None)
    assert out == [[4, 5, 9], [7, 8, 3]]
    # a seeded row's result depends only on its generator, not on the rows around it
    g = torch.Generator().manual_seed(0)
    p = torch.stack([_dist(g) for _ in range(3)])

    def run(rows_before):
        rows = [VerifyRow([1, 2], None, greedy=False) for _ in range(rows_before)]
        results = []
        gen = torch.Generator().manual_seed(42)
        for _ in range(30):
            seeded = VerifyRow([1, 2], None, greedy=False, generator=gen)
            target = p.repeat(len(rows) + 1, 1)
            results.append(verify(rows + [seeded], target.argmax(-1), target)[-1])
        return results

    assert run(0) == run(5)
    assert len({tuple(r) for r in run(0)}) > 3


# ---------------------------------------------------------------------------------------------
# scheduler: token budget, rollback, policies

def _decoding(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 50) -> Request:
    req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(temperature=0.0, max_tokens=max_tokens))
    s.add(req)
    return req


def test_token_budget_counts_proposals_and_rollback_trims_blocks():
    bm = BlockManager(64, 4, False, 0)
    s = make_scheduler(bm, max_num_batched_tokens=6, speculative_method="ngram", num_speculative_tokens=4)
    a, b = _decoding(s, "a", 5), _decoding(s, "b", 5)
    while not (a.num_output_tokens and b.num_output_tokens):     # prefill both (chunked)
        out = s.schedule()
        s.update(out, {r.req.request_id: [7] for r in out.seqs if r.sample})
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4], [1, 2, 3, 4]
    out = s.schedule()
    ks = {q.req.request_id: len(q.spec_token_ids) for q in out.seqs}
    assert ks == {"a": 4, "b": 0}                       # a: 1 + 4 tokens; b gets the last one
    assert out.num_batched_tokens == 6
    qa = next(q for q in out.seqs if q.req is a)
    assert len(a.block_table) == bm.blocks_needed(qa.start + 5)   # slots for the proposals
    n_before = a.num_tokens
    s.update(out, {"a": [1, 9], "b": [7]})             # a: one proposal accepted, then 9
    assert a.output_token_ids[-2:] == [1, 9] and a.num_tokens == n_before + 2
    assert a.num_computed_tokens == a.num_tokens - 1    # the rejected proposals are not computed
    assert len(a.block_table) == bm.blocks_needed(a.num_tokens)   # and their blocks returned
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (1, 4, 1)
    assert a.spec_k == 3                                # adaptive: fewer than half accepted
    assert a.spec_token_ids == []                       # the engine proposes anew
    # max_tokens caps the proposals: 2 tokens left -> at most 1 proposal
    a.sampling_params.max_tokens = a.num_output_tokens + 2
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert [len(q.spec_token_ids) for q in out.seqs if q.req is a] == [1]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_turns_off_under_load_and_back_on(method):
    """speculative_max_batch_tokens = 8: each row verifies (and asks the runner's proposers for)
    at most 8 // n - 1 proposals for n running and waiting requests: 7 alone, 3 beside one
    other, 1 at four, none at five (a waiting request counts). Only a draft model gets
    lookahead slots (1 + m past the verified proposals) for the proposals it is asked for."""
    bm = BlockManager(256, 4, False, 0)
    s = make_scheduler(bm, max_num_batched_tokens=64, speculative_method=method, num_speculative_tokens=8,
                       speculative_adaptive=False, speculative_max_batch_tokens=8)
    reqs = [_decoding(s, f"r{i}", 5) for i in range(5)]
    out = s.schedule()
    s.update(out, {q.req.request_id: [7] for q in out.seqs if q.sample})      # all prefilled

    def step(live):
        for r in live:
            r.spec_token_ids = list(range(100, 108))
        out = s.schedule()
        got = {q.req.request_id: (len(q.spec_token_ids), q.num_proposals) for q in out.seqs}
        for q in out.seqs:
            m = q.num_proposals
            slots = q.start + 1 + len(q.spec_token_ids) + (1 + m if m and method == "draft" else 0)
            assert len(q.req.block_table) == -(-slots // 4), (method, q)
        s.update(out, {q.req.request_id: [7] for q in out.seqs})              # every proposal rejected
        return got

    for n, k in ((5, 0), (4, 1), (2, 3), (1, 7)):
        while len(s.running) > n:                                 # the batch shrinks
            s.finish(s.running[-1], FinishReason.ABORT)
        got = step(s.running)
        assert set(got) == {r.request_id for r in s.running}
        assert all(v == (k, k) for v in got.values()), (n, got)
    assert reqs[0].num_drafts >= 3
    for i in range(4):
        _decoding(s, f"w{i}", 5)                # waiting requests count: five in all
    assert s._speculation_cap(frozenset()) == 0
    uncapped = make_scheduler(BlockManager(256, 4, False, 0), max_num_batched_tokens=64, speculative_method=method,
                              num_speculative_tokens=8, speculative_adaptive=False)
    assert uncapped._speculation_cap(frozenset()) == 8
    with pytest.raises(EngineError, match="speculative_max_batch_tokens"):
        EngineConfig(model="m", speculative_method=method, draft_model="d", speculative_max_batch_tokens=-1)


def test_speculation_needs_continuous_policy():
    with pytest.raises(EngineError, match="continuous"):
        make_scheduler(BlockManager(8, 4, False, 0), "static", speculative_method="ngram",
                       num_speculative_tokens=2)


def test_requests_with_penalties_logprobs_or_min_tokens_do_not_speculate():
    for sp in (SamplingParams(presence_penalty=0.5), SamplingParams(repetition_penalty=1.2),
               SamplingParams(logprobs=1), SamplingParams(min_tokens=3, max_tokens=8)):
        req = Request("r", [1, 2], sp, spec_k=4)
        assert not req.can_speculate()
    assert Request("r", [1, 2], SamplingParams(temperature=0.7, top_p=0.9), spec_k=4).can_speculate()


# ---------------------------------------------------------------------------------------------
# engines on SmolLM2

@pytest.fixture(scope="module")
def base(h, smollm2_dir):
    return h.make_engine(smollm2_dir)


@pytest.fixture(scope="module")
def ngram(h, base):
    """Speculation uncapped (speculative_max_batch_tokens 0): every row of a mixed batch speculates."""
    return h.derive_engine(base, speculative_method="ngram", speculative_max_batch_tokens=0)


@pytest.fixture(autouse=True)
def _fresh_prefix_caches(request):
    """``base`` and ``ngram`` share one KV pool (conftest.WrappedExecutor): each one's prefix
    cache may name blocks the other has overwritten since, so both start every test empty."""
    for name in ("base", "ngram"):
        if name in request.fixturenames:
            request.getfixturevalue(name).block_manager.reset_prefix_cache()


@pytest.fixture(scope="module")
def draft(h, smollm2_dir):
    """The draft is SmolLM2's own first 8 layers, with a 160-token context; speculation uncapped."""
    return h.make_engine(smollm2_dir, speculative_method="draft", draft_model=str(smollm2_dir),
                         draft_num_layers=8, draft_max_model_len=160, speculative_max_batch_tokens=0)


def _repetitive(prose_ids, n=80, again=30):
    """A prompt that ends by repeating its own beginning: prompt lookup finds long matches."""
    return prose_ids[:n] + prose_ids[:again]


def _mixed(prose_ids, h):
    return [("copy", _repetitive(prose_ids), h.greedy(24)),
            ("plain", prose_ids[100:150], h.greedy(12)),
            ("penalty", _repetitive(prose_ids, 60, 20), h.greedy(10, presence_penalty=0.5)),
            ("logprobs", prose_ids[7:40], h.greedy(6, logprobs=2)),
            ("min", prose_ids[30:70], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5))]


def _outputs(h, engine, requests):
    return {rid: r.output_token_ids for rid, r in h.run(engine, requests).items()}


def _assert_blocks_trimmed(engine):
    """Every running request holds no block beyond its tokens (and the next step's slots)."""
    bm = engine.block_manager
    for r in engine.scheduler.running:
        assert len(r.block_table) <= bm.blocks_needed(r.num_tokens), r.request_id


def _run_checked(h, engine, requests):
    """Like h.run, checking the rollback after every step; returns {id: Request}."""
    reqs = {rid: engine.add_request(rid, ids, sp) for rid, ids, sp in requests}
    while engine.has_unfinished_requests():
        engine.step()
        _assert_blocks_trimmed(engine)
    engine.step()
    return reqs


def test_ngram_greedy_identical_alone_and_mixed(h, base, ngram, prose_ids):
    requests = _mixed(prose_ids, h)
    ref = _outputs(h, base, requests)
    alone = _run_checked(h, ngram, requests[:1])["copy"]
    assert alone.output_token_ids == ref["copy"]
    assert alone.num_accepted_tokens >= 6          # it copies: proposals get accepted
    mixed = _run_checked(h, ngram, requests)
    assert {rid: r.output_token_ids for rid, r in mixed.items()} == ref
    for rid in ("penalty", "logprobs"):
        assert mixed[rid].num_drafts == 0, rid     # they decoded normally in the same batches
    assert mixed["min"].num_draft_tokens <= 8 - 5  # only once min_tokens were out
    assert mixed["plain"].num_drafts + mixed["copy"].num_drafts > 0
    assert len(mixed["logprobs"].output_logprobs) == 6
    assert ngram.stats().used == 0


def test_draft_greedy_identical_and_past_draft_context(h, base, draft, prose_ids):
    requests = _mixed(prose_ids, h) + [
        ("long", prose_ids[:170], h.greedy(4)),               # prompt past the draft's 160 tokens
        ("grows", prose_ids[180:], h.greedy(24))]              # 149 tokens: outgrows it decoding
    ref = _outputs(h, base, requests)
    got = _run_checked(h, draft, requests)
    assert {rid: r.output_token_ids for rid, r in got.items()} == ref
    assert got["long"].num_drafts == 0
    assert got["grows"].num_draft_tokens > 0
    assert got["grows"].num_drafts < 15                   # stopped speculating at 160 tokens
    assert got["copy"].num_draft_tokens > 0 and got["penalty"].num_drafts == 0
    assert draft.stats().used == 0


def _draft_forwards(engine) -> list[int]:
    """A counter of the engine's draft model forwards (``[n]``, updated in place)."""
    model = engine.executor.runner.proposer.model
    n, forward = [0], model.forward

    def counted(*a, **kw):
        n[0] += 1
        return forward(*a, **kw)

    model.forward = counted
    return n


def test_ngram_plus_draft_greedy_identical_and_the_draft_sits_out_lookup_runs(h, base, draft, smollm2_dir,
                                                                               prose_ids):
    """``ngram+draft``: prompt lookup where the sequence repeats itself, the draft elsewhere;
    greedy output is the target's, and the copying request needs fewer draft forwards than
    under ``draft`` alone."""
    both = h.make_engine(smollm2_dir, speculative_method="ngram+draft", draft_model=str(smollm2_dir),
                         draft_num_layers=8, draft_max_model_len=160, speculative_max_batch_tokens=0)
    try:
        requests = _mixed(prose_ids, h)
        ref = _outputs(h, base, requests)
        got = _run_checked(h, both, requests)
        assert {rid: r.output_token_ids for rid, r in got.items()} == ref
        assert got["plain"].num_drafts > 0 and got["copy"].num_accepted_tokens >= 6
        copy = requests[:1]
        n_both, n_draft = _draft_forwards(both), _draft_forwards(draft)
        alone = h.run(both, copy)["copy"]
        assert alone.output_token_ids == ref["copy"] and alone.num_accepted_tokens >= 6
        h.run(draft, copy)
        assert 0 < n_both[0] < n_draft[0]
        assert both.stats().used == 0
    finally:
        both.shutdown()


def test_draft_off_under_load_and_back_on_greedy_identical(h, base, smollm2_dir, prose_ids):
    """With the default cap (speculative_max_batch_tokens 5), three or more decoding rows verify
    nothing and the draft runs no forward; as the batch shrinks, speculation comes back (two rows
    one proposal each, one row four), the draft catching up on the tokens it skipped; greedy
    output stays the target's."""
    eng = h.make_engine(smollm2_dir, speculative_method="draft", draft_model=str(smollm2_dir))
    try:
        assert eng.cfg.speculative_max_batch_tokens == 5
        requests = [(f"r{i}", prose_ids[20 * i: 20 * i + 40], h.greedy(6 + 8 * i)) for i in range(6)]
        ref = _outputs(h, base, requests)
        forwards, steps, asks = _draft_forwards(eng), [], []
        schedule = eng.scheduler.schedule

        def spy(*a, **kw):
            out = schedule(*a, **kw)
            dec = [q for q in out.seqs if q.num_new_tokens == 1]
            steps.append((len(dec), max((len(q.spec_token_ids) + q.num_proposals for q in out.seqs), default=0),
                          forwards[0]))
            asks.append((len(dec), max((q.num_proposals for q in dec), default=0)))     # proposals asked per row
            return out

        eng.scheduler.schedule = spy
        got = h.run(eng, requests)
        assert {rid: r.output_token_ids for rid, r in got.items()} == ref
        full = [i for i, (d, _, _) in enumerate(steps) if d >= 3]
        assert full and all(steps[i][1] == 0 for i in full)                 # off under load ...
        assert all(steps[i + 1][2] == steps[i][2] for i in full[:-1] if i + 1 in full)   # ... no draft forward
        assert all(a <= 1 for d, a in asks if d == 2) and any(d == 2 and a == 1 for d, a in asks)
        assert any(d == 1 and a == 4 for d, a in asks)                      # on again as the batch shrinks
        assert got["r5"].num_accepted_tokens > 0                            # the draft caught up right
        assert eng.stats().used == 0
    finally:
        eng.shutdown()


def test_prefix_cache_hits_on_speculated_blocks(h, base, ngram, prose_ids):
    """Blocks filled by speculative steps are cached with their accepted tokens' K/V: a
    prompt that continues a speculated output hits them and decodes as plain greedy does."""
    prompt = _repetitive(prose_ids)
    ref_first = _outputs(h, base, [("first", prompt, h.greedy(40))])["first"]
    follow = prompt + ref_first[:-1] + prose_ids[200:210]
    ref = _outputs(h, base, [("follow", follow, h.greedy(8))])
    # (base and ngram share the KV pool: ngram runs after base is done with it)
    first = h.run(ngram, [("first", prompt, h.greedy(40))])["first"]
    assert first.output_token_ids == ref_first and first.num_accepted_tokens > 0
    got = h.run(ngram, [("follow", follow, h.greedy(8))])["follow"]
    assert got.num_cached_tokens > first.num_prompt_tokens + h.BLOCK    # hits on output blocks
    assert got.output_token_ids == ref["follow"]


def test_draft_equal_to_target_accepts_every_proposal(h, smollm2_dir, prose_ids):
    """A draft that is the target itself proposes exactly the target's greedy tokens, so every
    proposal is accepted, if and only if its KV cache is right: prefill chunks (chunked,
    prefix-cache hits), the lookahead slots, rollback of its own proposals, block reuse."""
    eng = h.make_engine(smollm2_dir, speculative_method="draft", draft_model=str(smollm2_dir),
                        max_num_batched_tokens=64, kv_cache_memory=24 * 2**20, max_model_len=256,
                        speculative_max_batch_tokens=0)
    try:
        reqs = _run_checked(h, eng, [("a", prose_ids[:70], h.greedy(20)), ("b", prose_ids[:90], h.greedy(16)),
                                     ("c", prose_ids[150:190], h.greedy(12, presence_penalty=0.3))])
        for rid in ("a", "b"):
            r = reqs[rid]
            assert r.num_draft_tokens > 0 and r.num_accepted_tokens == r.num_draft_tokens, rid
        assert reqs["b"].num_cached_tokens > 0                        # a prefix-cache hit on a's blocks
    finally:
        eng.shutdown()


def test_sampling_with_speculation_is_seeded_and_valid(h, ngram, prose_ids):
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    prompt = _repetitive(prose_ids)
    one = h.run(ngram, [("s", prompt, sp)])["s"]
    two = h.run(ngram, [("s", prompt, sp), ("other", prose_ids[:50], h.greedy(8))])["s"]
    assert one.output_token_ids == two.output_token_ids and len(one.output_token_ids) == 16
    assert one.num_draft_tokens > 0


def _deltas(h, engine, prompt, sp):
    """Run one request, returning its per-step new token lists."""
    engine.add_request("d", prompt, sp)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.new_token_ids for o in engine.step() if o.new_token_ids]
    engine.step()
    return deltas


def _inside_run(deltas):
    """Index (in the output) of a token in the middle of a multi-token step."""
    pos = 0
    for d in deltas:
        if len(d) >= 3:
            return pos + 1
        pos += len(d)
    raise AssertionError("no step accepted two proposals")


def _stop_inside_delta(tokenizer, deltas):
    """A stop string that completes at a token in the middle of a multi-token delta (that
    token's text, first seen there): (stop, the text before it, the token's index)."""
    full = [t for d in deltas for t in d]
    text = tokenizer.decode(full)
    pos = 0
    for d in deltas:
        for i in range(pos, pos + len(d) - 1):            # not the delta's last token
            before = tokenizer.decode(full[:i])
            piece = tokenizer.decode(full[: i + 1])[len(before):]
            if len(piece.strip()) >= 3 and text.find(piece) == len(before):
                return piece, before, i
        pos += len(d)
    raise AssertionError("no usable stop string inside a multi-token delta")


def test_stops_inside_an_accepted_run(h, ngram, prose_ids, smollm2_tokenizer):
    prompt = _repetitive(prose_ids)
    deltas = _deltas(h, ngram, prompt, h.greedy(24))
    full = [t for d in deltas for t in d]
    j = _inside_run(deltas)
    j = next(i for i in range(j, len(full)) if full.index(full[i]) == i)   # first occurrence of its id
    assert any(len(d) > 1 for d in deltas)
    # max_tokens inside the run
    r = h.run(ngram, [("m", prompt, h.greedy(j + 1))])["m"]
    assert r.output_token_ids == full[: j + 1] and r.finish_reason == FinishReason.LENGTH
    # a stop token id (as an EOS would) inside the run: nothing after it
    r = h.run(ngram, [("e", prompt, h.greedy(24, stop_token_ids=[full[j]]))])["e"]
    assert r.output_token_ids == full[: j + 1]
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == full[j]
    # a stop string (a token's text, first seen there) completing in the middle of a
    # multi-token delta: the text layer cuts exactly there
    from gateway.output_processor import OutputProcessor
    from kvmesh.llm import _step          # kvmesh.llm's fold of an engine output into the processor
    stop, cut, last = _stop_inside_delta(smollm2_tokenizer, deltas)
    sp = h.greedy(24, stop=[stop])
    output = OutputProcessor(smollm2_tokenizer, prompt, sp, cumulative=True)
    ngram.add_request("t", prompt, sp)
    multi, d = False, None
    while d is None or not d.finished:
        for o in ngram.step():
            multi |= len(o.new_token_ids) > 1
            d = _step(output, o)
            if d.end_upstream:
                ngram.finish_request("t", FinishReason.STOP, d.stop_reason)
    ngram.step()
    assert multi and output.text == cut and (d.finish_reason, d.stop_reason) == ("stop", stop)
    assert output.token_ids == full[: last + 1]            # nothing after the stop's token
    m = output.metrics                                     # kvmesh.llm's RequestOutput.metrics
    assert m.num_drafts > 0 and m.acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens
    assert ngram.stats().used == 0


def test_abort_mid_speculation_frees_every_block(h, draft, prose_ids):
    reqs = [draft.add_request(f"a{i}", _repetitive(prose_ids, 60 + 10 * i), h.greedy(40)) for i in range(3)]
    for _ in range(50):
        draft.step()
        if all(r.num_drafts > 0 and r.spec_token_ids for r in reqs):
            break
    assert all(r.num_drafts > 0 for r in reqs)
    for r in reqs:
        assert draft.abort_request(r.request_id)
    outs = draft.step()
    assert {o.request_id for o in outs if o.finished} == {r.request_id for r in reqs}
    assert draft.stats().used == 0 and not draft.executor.runner.draft_probs


def test_metrics_in_final_output(h, ngram, prose_ids):
    ngram.add_request("m", _repetitive(prose_ids), h.greedy(16))
    final = None
    while ngram.has_unfinished_requests():
        for o in ngram.step():
            final = o
    assert final.finished and final.num_drafts > 0
    assert 0 < final.num_accepted_tokens <= final.num_draft_tokens
    assert final.acceptance_rate == final.num_accepted_tokens / final.num_draft_tokens
    assert 1 < final.mean_accepted_length <= 1 + ngram.cfg.num_speculative_tokens
    # every token came from a speculative step or a plain one (the first comes from the prefill)
    assert final.num_accepted_tokens + final.num_drafts <= final.num_output_tokens - 1
    assert ngram.spec_propose_seconds > 0


def test_speculation_rejected_under_static_policy(h, base):
    with pytest.raises(EngineError, match="continuous"):
        h.derive_engine(base, policy="static", speculative_method="ngram")


# ---------------------------------------------------------------------------------------------
# gRPC: acceptance counts in the final message

async def test_grpc_final_message_carries_acceptance(smollm2_dir, prose_ids, smollm2_tokenizer):
    import grpc

    from gateway.server import serve_gateway
    from kvmesh.core.service_config import GatewayConfig
    from kvmesh.v1 import common_pb2, llm_pb2, llm_pb2_grpc
    from scheduler.service import serve_scheduler
    sched = await serve_scheduler(SchedulerConfig(executor="local", port=0),
                                  EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=32 * 2**20,
                                               max_model_len=256, speculative_method="ngram"))
    gw = None
    try:
        await sched.wait_ready()
        gw = await serve_gateway(GatewayConfig(port=0, scheduler_address=sched.address, connect_timeout=60,
                                               default_timeout=60, max_timeout=120))
        async with grpc.aio.insecure_channel(gw.address) as ch:
            stub = llm_pb2_grpc.LLMServiceStub(ch)
            req = llm_pb2.GenerateRequest(
                prompt_token_ids=llm_pb2.TokenIds(ids=_repetitive(prose_ids)),
                sampling=common_pb2.SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24))
            msgs = [m async for m in stub.Generate(req)]
            final = msgs[-1]
            assert final.finished and final.usage.completion_tokens == 24
            u = final.usage
            assert u.spec_num_drafts > 0 and 0 < u.spec_num_accepted_tokens <= u.spec_num_draft_tokens
            assert any(len(m.token_ids) > 1 for m in msgs)        # accepted tokens stream together
            # a stop string completing inside a multi-token message: cut exactly there
            deltas = [list(m.token_ids) for m in msgs if m.token_ids]
            stop, cut, last = _stop_inside_delta(smollm2_tokenizer, deltas)
            req.sampling.stop.append(stop)
            msgs = [m async for m in stub.Generate(req)]
        full = [t for d in deltas for t in d]
        assert "".join(m.text for m in msgs) == cut and msgs[-1].stop_reason == stop
        assert [t for m in msgs for t in m.token_ids] == full[: last + 1]
        assert msgs[-1].usage.completion_tokens == last + 1
    finally:
        if gw is not None:
            await gw.stop(0)
        await sched.stop(0)


# ---------------------------------------------------------------------------------------------
# pipeline parallelism (Ray): the last stage verifies and proposes (the draft, or prompt lookup
# over the request's prompt and output as its step decoder holds them)

@pytest.fixture(scope="module")
def ray_local():
    import ray

    from workers.executor import ensure_ray
    ensure_ray(num_cpus=8)
    yield
    ray.shutdown()


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_pp2_speculation_greedy_identical_with_micro_batches(h, base, ray_local, smollm2_dir, prose_ids, method):
    from workers.executor import create_executor
    sc = SchedulerConfig(pp=2, stage_num_cpus=1)
    draft = dict(draft_model=str(smollm2_dir), draft_num_layers=8) if method == "draft" else {}
    cfg = EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=64 * 2**20, max_model_len=512,
                       num_threads=1, speculative_method=method, max_num_batched_tokens=96,
                       speculative_max_batch_tokens=0, **draft)       # uncapped: all four speculate in every micro-batch
    eng = LLMEngine(cfg, executor_factory=lambda c, d: create_executor(c, d, sc))
    try:
        requests = _mixed(prose_ids, h)[:3] + [("q3", prose_ids[40:90], h.greedy(20))]
        ref = _outputs(h, base, requests)

        async def stream():
            ae = AsyncEngine(eng)

            async def one(rid, ids, sp):
                toks = []
                async for o in ae.generate(rid, ids, sp):
                    toks += o.new_token_ids
                return rid, toks, o

            try:
                return await asyncio.gather(*(one(*r) for r in requests))
            finally:
                await ae.shutdown()

        res = asyncio.run(stream())
        assert {rid: toks for rid, toks, _ in res} == ref
        finals = {rid: o for rid, _, o in res}
        assert finals["copy"].num_draft_tokens > 0 and finals["penalty"].num_drafts == 0
        if method == "ngram":                   # the copying request's lookups come true
            assert finals["copy"].num_accepted_tokens > 0
        assert eng.stats().used == 0
    finally:
        eng.shutdown()
