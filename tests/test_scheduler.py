"""Scheduler unit tests (no model): a fake model "samples" a fixed token for every sequence
whose chunk ends at its last token."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import EngineError
from kvmesh.core.sampling import SamplingParams
from scheduler.block_manager import BlockManager
from scheduler.batching import make_scheduler
from scheduler.request import FinishReason, Request, RequestStatus

BS = 4


def make(num_blocks=64, policy="continuous", caching=False, **kw):
    kw.setdefault("max_model_len", 256)
    return make_scheduler(BlockManager(num_blocks, BS, caching, 0), policy, **kw)


def add(s, rid, n_prompt, max_tokens=4, start=0):
    r = Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    s.add(r)
    return r


def step(s, token=7):
    out = s.schedule()
    s.update(out, {q.req.request_id: [token] for q in out.seqs if q.sample})
    return out


def drain(s, limit=1000):
    outs = []
    while s.has_unfinished() and limit:
        outs.append(step(s))
        limit -= 1
    assert not s.has_unfinished()
    return outs


def plan(out):
    return [(q.req.request_id, q.start, q.num_new_tokens, q.sample) for q in out.seqs]


# ---------------------------------------------------------------------------------------------
# continuous

def test_token_budget_respected_and_prefill_chunked():
    s = make(max_num_batched_tokens=32)
    reqs = [add(s, f"r{i}", 20, start=100 * i) for i in range(4)]
    first = step(s)
    assert plan(first) == [("r0", 0, 20, True), ("r1", 0, 12, False)]
    assert first.num_batched_tokens == 32
    for out in drain(s):
        assert 0 < out.num_batched_tokens <= 32
    assert all(len(r.output_token_ids) == 4 for r in reqs)
    assert s.bm.stats().used == 0


def test_decodes_are_scheduled_before_prefills():
    s = make(max_num_batched_tokens=16)
    a, b = add(s, "a", 5, max_tokens=10), add(s, "b", 6, max_tokens=10, start=50)
    step(s)                                  # both prefilled
    c = add(s, "c", 40, start=200)
    out = step(s)
    assert plan(out) == [("a", 5, 1, True), ("b", 6, 1, True), ("c", 0, 14, False)]
    out = step(s)                            # decodes still come first, c gets the rest
    assert plan(out) == [("a", 6, 1, True), ("b", 7, 1, True), ("c", 14, 14, False)]



def test_prefill_cap_applies_only_to_steps_that_decode():
    """max_prefill_tokens_with_decodes: a long prompt next to running decodes advances by at
    most the cap per step (running chunked prefill and new admissions together), each step
    still decoding; a step with no decode row prefills the whole budget."""
    s = make(max_num_batched_tokens=64, max_prefill_tokens_with_decodes=8)
    c = add(s, "c", 100, start=300)
    assert plan(step(s)) == [("c", 0, 64, False)]            # no decodes: the whole budget
    assert plan(step(s)) == [("c", 64, 36, True)]
    a = add(s, "a", 5, max_tokens=10)
    b = add(s, "b", 20, start=50)
    out = step(s)                                            # c decodes: a and b share the cap
    assert plan(out) == [("c", 100, 1, True), ("a", 0, 5, True), ("b", 0, 3, False)]
    out = step(s)
    assert plan(out) == [("c", 101, 1, True), ("a", 5, 1, True), ("b", 3, 8, False)]
    out = step(s)                                            # the running prefill keeps the cap
    assert plan(out) == [("c", 102, 1, True), ("a", 6, 1, True), ("b", 11, 8, False)]
    drain(s)
    assert [len(r.output_token_ids) for r in (a, b, c)] == [10, 4, 4] and s.bm.stats().used == 0
    with pytest.raises(EngineError, match="max_prefill_tokens_with_decodes"):
        make(max_prefill_tokens_with_decodes=-1)


def test_max_num_seqs_respected():
    s = make(max_num_seqs=2)
    reqs = [add(s, f"r{i}", 5, max_tokens=3 + i, start=10 * i) for i in range(5)]
    admitted_order = []
    while s.has_unfinished():
        out = step(s)
        assert len(out.seqs) <= 2 and len(s.running) <= 2
        for q in out.seqs:
            if q.start == 0:
                admitted_order.append(q.req.request_id)
    assert admitted_order == ["r0", "r1", "r2", "r3", "r4"]
    assert [len(r.output_token_ids) for r in reqs] == [3, 4, 5, 6, 7]


def test_preemption_picks_most_recently_admitted():
    # 6 blocks of 4 tokens; three 7-token prompts take 2 blocks each; the first decode that
    # crosses a block boundary must preempt
    s = make(num_blocks=6, max_model_len=64)
    a, b, c = (add(s, x, 7, max_tokens=10, start=20 * i) for i, x in enumerate("abc"))
    out = step(s)
    assert [q.req.request_id for q in out.seqs] == ["a", "b", "c"] and s.bm.num_free_blocks == 0
    step(s)                                  # tokens 7 -> 8: still in block 2
    out = s.schedule()                       # token 9 needs a third block for a
    assert out.preempted == ["c"]
    assert c.status == RequestStatus.PREEMPTED and c.block_table == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert list(s.waiting) == [c] and s.running == [a, b]
    assert [q.req.request_id for q in out.seqs] == ["a", "b"]    # b got c's freed block
    s.update(out, {"a": [7], "b": [7]})
    # c keeps its generated tokens and later resumes by recomputing prompt + output
    assert len(c.output_token_ids) == 2
    drain(s)
    assert [len(r.output_token_ids) for r in (a, b, c)] == [10, 10, 10]
    assert s.bm.stats().used == 0


def test_prefix_cache_counts_each_prompt_once_under_preemption():
    """A re-admission after a preemption is not a new prefix-cache query: queries and hits count
    each prompt once (first admission, as the requests' ``num_cached_tokens``); what the
    re-admission looks up again (prompt + output so far) is counted apart."""
    s = make(num_blocks=6, max_model_len=64, caching=True)
    a, b, c = (add(s, x, 7, max_tokens=10, start=20 * i) for i, x in enumerate("abc"))
    step(s)
    step(s)
    out = step(s)                            # c is preempted with 2 output tokens
    assert out.preempted == ["c"] and len(c.output_token_ids) == 2
    drain(s)                                 # b is preempted later with 6 output tokens
    assert [r.num_preemptions for r in (a, b, c)] == [0, 1, 1]
    st = s.bm.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (21, 0)      # 3 prompts of 7, once
    assert [r.num_cached_tokens for r in (a, b, c)] == [0, 0, 0]
    # re-admissions: b with 13 tokens (its first 2 blocks still cached), c with 9 (evicted)
    assert (st.preempted_queries, st.preempted_hits) == (13 + 9, 8)
    # a later request on c's prompt hits its cached blocks: counted as a first admission
    d = add(s, "d", 7, max_tokens=2, start=40)
    drain(s)
    st = s.bm.stats()
    assert d.num_cached_tokens == 4 and (st.prefix_cache_queries, st.prefix_cache_hits) == (28, 4)
    assert (st.preempted_queries, st.preempted_hits) == (22, 8)


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=4, max_model_len=64)
    a = add(s, "a", 4, max_tokens=8)
    b = add(s, "b", 4, max_tokens=8, start=30)
    step(s)
    add(s, "late", 1, max_tokens=1, start=60)
    preempted_steps = 0
    while s.has_unfinished():
        running_before = {r.request_id for r in s.running}
        out = s.schedule()
        if out.preempted:
            preempted_steps += 1
            assert s.waiting                  # someone could have been admitted...
            assert {q.req.request_id for q in out.seqs} <= running_before    # ...but was not
        s.update(out, {q.req.request_id: [7] for q in out.seqs if q.sample})
    assert preempted_steps > 0
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8


def test_prefix_hits_skip_computation():
    s = make(caching=True, max_num_batched_tokens=64)
    a = add(s, "a", 10, max_tokens=1)
    drain(s)
    b = add(s, "b", 10, max_tokens=1)        # 2 full blocks cached; the last (partial) is computed
    out = step(s)
    assert plan(out) == [("b", 8, 2, True)]
    assert b.num_cached_tokens == 8
    c = add(s, "c", 8, max_tokens=1)         # fully cached: its last block is recomputed
    out = step(s)
    assert plan(out) == [("c", 4, 4, True)]
    assert a.output_token_ids == b.output_token_ids == [7]


def test_chunked_prefill_disabled_waits_for_room():
    s = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a = add(s, "a", 10, max_tokens=3)
    b = add(s, "b", 10, max_tokens=3, start=50)
    out = step(s)
    assert plan(out) == [("a", 0, 10, True)]            # b would need splitting: it waits
    out = step(s)
    assert plan(out) == [("a", 10, 1, True), ("b", 0, 10, True)]
    with pytest.raises(EngineError, match="chunked prefill disabled"):
        add(s, "huge", 17)
    drain(s)


def test_finish_frees_waiting_and_running():
    s = make(max_num_seqs=1)
    a, b = add(s, "a", 9, max_tokens=20), add(s, "b", 9, max_tokens=20, start=40)
    step(s)
    assert s.bm.stats().used == 3 and b in s.waiting
    s.finish(b, FinishReason.ABORT)
    assert b not in s.waiting and b.is_finished and "b" not in s.requests
    s.finish(a, FinishReason.ABORT)
    assert s.running == [] and s.bm.stats().used == 0 and not s.has_unfinished()
    s.finish(a, FinishReason.STOP)                      # idempotent
    assert a.finish_reason == FinishReason.ABORT


def test_add_validation():
    s = make(num_blocks=4, max_model_len=32)
    add(s, "ok", 10, max_tokens=6)
    with pytest.raises(EngineError, match="duplicate request id 'ok'"):
        add(s, "ok", 3)
    with pytest.raises(EngineError, match="exceeds max_model_len 32"):
        add(s, "long", 30, max_tokens=4)
    with pytest.raises(EngineError, match="needs 5 KV blocks of 4 tokens; the whole pool has 4"):
        add(s, "big", 17, max_tokens=2)
    with pytest.raises(EngineError, match="unknown scheduling policy"):
        make(policy="lottery")


# ---------------------------------------------------------------------------------------------
# static and naive

def test_static_admits_nothing_until_the_batch_is_done():
    s = make(policy="static", max_num_seqs=4)
    a = add(s, "a", 5, max_tokens=2)
    b = add(s, "b", 7, max_tokens=5, start=20)
    out = step(s)
    assert plan(out) == [("a", 0, 5, True), ("b", 0, 7, True)]
    # KV for prompt + max_tokens reserved up front
    assert len(a.block_table) == 2 and len(b.block_table) == 3
    c = add(s, "c", 3, max_tokens=1, start=40)      # arrives while the batch runs (2 free rows)
    step(s)                                  # a finishes (2 tokens)
    assert a.is_finished and c.status == RequestStatus.WAITING
    used = s.bm.stats().used
    for i in range(3):
        out = step(s)
        assert "c" not in [q.req.request_id for q in out.seqs]
        pad = [q for q in out.seqs if q.req is a]
        assert len(pad) == 1 and pad[0].padding      # a keeps its row, as padding
        if i < 2:
            assert s.bm.stats().used == used         # and its blocks
    assert b.is_finished and len(b.output_token_ids) == 5 and len(a.output_token_ids) == 2
    assert s.bm.stats().used == 0                    # the batch ended: all rows released
    out = step(s)
    assert plan(out) == [("c", 0, 3, True)]
    assert not s.has_unfinished() and s.bm.stats().used == 0


def test_static_whole_prompts_regardless_of_budget():
    s = make(policy="static", max_num_batched_tokens=8)
    add(s, "a", 30, max_tokens=1)
    assert plan(s.schedule()) == [("a", 0, 30, True)]


def test_naive_recomputes_everything_one_at_a_time():
    s = make(policy="naive", max_num_seqs=8)
    a = add(s, "a", 5, max_tokens=3)
    add(s, "b", 4, max_tokens=2, start=30)
    outs = drain(s)
    assert [plan(o) for o in outs] == [
        [("a", 0, 5, True)], [("a", 0, 6, True)], [("a", 0, 7, True)],
        [("b", 0, 4, True)], [("b", 0, 5, True)]]
    assert a.output_token_ids == [7, 7, 7]


# ---------------------------------------------------------------------------------------------
# micro-batches in flight (pipeline parallelism)

def test_busy_requests_are_skipped_and_two_micro_batches_interleave():
    s = make(max_num_batched_tokens=64)
    a, b = add(s, "a", 8), add(s, "b", 8, start=100)
    first = s.schedule()                                   # both prefills
    assert {q.req.request_id for q in first.seqs} == {"a", "b"}
    s.update(first, {"a": [7], "b": [7]})
    mb1 = s.schedule(busy={"b"})                           # b still in flight elsewhere
    assert plan(mb1) == [("a", 8, 1, True)]
    mb2 = s.schedule(busy={"a"})
    assert plan(mb2) == [("b", 8, 1, True)]
    assert s.schedule(busy={"a", "b"}).empty               # nothing idle: an empty micro-batch
    s.update(mb1, {"a": [7]})
    s.update(mb2, {"b": [7]})
    assert a.num_output_tokens == b.num_output_tokens == 2


def test_preemption_never_takes_a_busy_request():
    s = make(num_blocks=6, max_num_batched_tokens=64)    # 24 token slots
    a = add(s, "a", 12, max_tokens=12)
    b = add(s, "b", 12, max_tokens=12, start=100)
    out = s.schedule()
    s.update(out, {"a": [7], "b": [7]})                        # 12 prompt tokens each: 3 + 3 blocks, pool full
    # a's next token needs a 4th block; b (admitted last) would be the victim, but it is busy
    mb = s.schedule(busy={"b"})
    assert mb.empty and mb.preempted == ["a"]              # a preempts itself rather than b
    assert b.status == RequestStatus.RUNNING and b.block_table
    assert a.status == RequestStatus.PREEMPTED and not a.block_table
