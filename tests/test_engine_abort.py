"""Aborting requests in the synchronous engine (tiny Llama): blocks come back at once, the
others finish unchanged, and an abort that lands while the model runs is handled."""

from __future__ import annotations

import pytest
import torch

from scheduler.request import FinishReason, RequestStatus


@pytest.fixture(scope="module")
def base(tiny_llama_dir, h):
    return h.make_engine(tiny_llama_dir)


@pytest.fixture
def prompts():
    g = torch.Generator().manual_seed(17)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 40, 7, 33)]


def _reference(h, base, prompts, n):
    eng = h.derive_engine(base, enable_prefix_caching=False)
    reqs = h.run(eng, [(f"ref-{i}", p, h.greedy(n)) for i, p in enumerate(prompts)])
    return [reqs[f"ref-{i}"].output_token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("caching", [False, True])
def test_abort_running_request_frees_blocks_at_once(base, h, prompts, caching):
    ref = _reference(h, base, prompts, 12)
    eng = h.derive_engine(base, enable_prefix_caching=caching)
    reqs = [eng.add_request(f"r{i}", p, h.greedy(12)) for i, p in enumerate(prompts)]
    for _ in range(3):
        eng.step()
    victim = reqs[1]
    assert victim.status == RequestStatus.RUNNING
    held = len(victim.block_table)
    assert held == 3                                   # 40 + 2 computed tokens
    used = eng.stats().used
    assert eng.abort_request("r1") is True
    assert eng.stats().used == used - held             # freed now, not at the next step
    assert victim.block_table == [] and victim.finish_reason == FinishReason.ABORT
    assert eng.abort_request("r1") is False            # already finished
    outs = {o.request_id: o for o in eng.step()}
    assert outs["r1"].finished and outs["r1"].finish_reason == FinishReason.ABORT
    assert outs["r1"].new_token_ids == []              # its 3 tokens were already reported
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats().used == 0
    assert len(victim.output_token_ids) == 3 and victim.output_token_ids == ref[1][:3]
    for i in (0, 2, 3):
        assert reqs[i].output_token_ids == ref[i]


def test_abort_waiting_and_unknown(base, h, prompts):
    eng = h.derive_engine(base, max_num_seqs=1)
    a = eng.add_request("a", prompts[0], h.greedy(4))
    b = eng.add_request("b", prompts[1], h.greedy(4))
    eng.step()
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert eng.abort_request("b") and b.finish_reason == FinishReason.ABORT
    assert eng.abort_request("no-such-id") is False
    outs = eng.step()
    assert any(o.request_id == "b" and o.finished for o in outs)
    while eng.has_unfinished_requests():
        eng.step()
    assert len(a.output_token_ids) == 4 and b.output_token_ids == []
    assert eng.stats().used == 0 and not eng.scheduler.requests


def test_abort_everything(base, h, prompts):
    eng = h.derive_engine(base, num_blocks=6)           # some wait, some get preempted
    for i, p in enumerate(prompts):
        eng.add_request(f"all-{i}", p, h.greedy(30))
    for _ in range(5):
        eng.step()
    for i in range(len(prompts)):
        assert eng.abort_request(f"all-{i}")
    assert eng.stats().used == 0
    assert not eng.has_unfinished_requests()
    finished = {o.request_id for o in eng.step() if o.finished}
    assert finished == {f"all-{i}" for i in range(len(prompts))}


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("at_call", [1, 3])
def test_abort_while_the_model_runs(base, h, prompts, policy, at_call, wrap_executor):
    """Abort lands between schedule() and update(): the step's result for that request is
    dropped, nothing crashes, the others are unaffected. at_call=1 is during the request's
    very first (prefill) step."""
    from scheduler.engine import LLMEngine
    ref = _reference(h, base, prompts, 8)
    holder = []

    def abort_r2(n):     # while step n runs, as a client disconnect would, from another thread
        if n == at_call:
            assert holder[0].abort_request("r2")

    cfg = base.cfg.replace(policy=policy, enable_prefix_caching=False)
    eng = LLMEngine(cfg, executor=wrap_executor(base.executor, before_step=abort_r2))
    holder.append(eng)
    reqs = [eng.add_request(f"r{i}", p, h.greedy(8)) for i, p in enumerate(prompts)]
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    eng.step()
    assert not eng.has_unfinished_requests()
    assert reqs[2].finish_reason == FinishReason.ABORT
    assert len(reqs[2].output_token_ids) == at_call - 1
    for i in (0, 1, 3):
        assert reqs[i].output_token_ids == ref[i], f"request {i}"
    assert eng.stats().used == 0
