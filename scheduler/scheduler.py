"""Batching policies: which requests run in the next model step, and how many tokens each.

- ``continuous``: iteration-level scheduling (Orca, Yu et al. 2022 OSDI; vLLM). Each step
  fills a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):
  running requests first (decodes, and the rest of chunked prefills), then waiting requests
  (chunked prefill, prefix-cache hits skipped). When KV blocks run out, the most recently
  admitted running request is preempted by recompute: its blocks are freed and it goes back
  to the front of the queue with its tokens so far.
- ``static``: a batch of up to ``max_num_seqs`` requests is admitted only when the previous
  batch is completely done, with KV reserved for prompt + max_tokens; whole prompts are
  prefilled in one step, and requests that finish early keep occupying (and computing) their
  row until the longest one ends, as in padded static batching.
- ``naive``: one request at a time with no KV reuse: every step re-runs the whole sequence.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.request import EngineError, FinishReason, Request, RequestStatus

POLICIES = ("continuous", "static", "naive")


@dataclass
class ScheduledSeq:
    """``num_new_tokens`` tokens of ``req`` starting at position ``start`` go through the model;
    ``sample`` is True when the chunk ends at the sequence's last token (a new token comes out)."""

    req: Request
    start: int
    num_new_tokens: int
    sample: bool
    padding: bool = False     # static batching: a finished row still occupying the batch


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    """Owns the waiting and running queues and the block manager of one replica.

    Args:
        block_manager: the replica's KV block accounting.
        policy: one of ``continuous``, ``static``, ``naive``.
        max_num_seqs: cap on running sequences.
        max_num_batched_tokens: token budget per step (continuous policy).
        max_model_len: longest sequence (prompt + output) in tokens.
        enable_chunked_prefill: split long prompts across steps (continuous policy).
    """

    def __init__(self, block_manager: BlockManager, *, policy: str = "continuous", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 2048,
                 enable_chunked_prefill: bool = True):
        if policy not in POLICIES:
            raise EngineError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
        self.bm = block_manager
        self.policy = policy
        self.max_num_seqs = 1 if policy == "naive" else max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request. Raises EngineError if it can never be served."""
        if req.request_id in self.requests:
            raise EngineError(f"duplicate request id {req.request_id!r}")
        total = req.num_prompt_tokens + req.sampling_params.max_tokens
        if total > self.max_model_len:
            raise EngineError(f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                              f"({req.sampling_params.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}")
        if self.bm.blocks_needed(total) > self.bm.num_blocks:
            raise EngineError(f"request needs {self.bm.blocks_needed(total)} KV blocks of {self.bm.block_size} tokens; "
                              f"the whole pool has {self.bm.num_blocks} (raise --kv-cache-memory)")
        if self.policy == "continuous" and not self.enable_chunked_prefill:
            # unchunked, a prompt (or, after a preemption, prompt + output so far) must be
            # prefilled in one step; a longer one would wait forever
            worst = total - 1
            if worst > self.max_num_batched_tokens:
                raise EngineError(f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                                  f"({req.sampling_params.max_tokens}) may need a {worst}-token prefill, over "
                                  f"max_num_batched_tokens {self.max_num_batched_tokens} with chunked prefill "
                                  f"disabled (enable chunked prefill or raise max_num_batched_tokens)")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self, busy: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        """The next step. ``busy``: ids of running requests whose previous micro-batch is still
        in flight (pipeline parallelism); they are neither scheduled nor preempted."""
        if self.policy == "static":
            return self._schedule_static()
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "naive":
            for req in self.running:
                req.num_computed_tokens = 0      # no KV reuse: recompute everything
            budget = self.max_model_len
        # 1) running requests: decodes and unfinished chunked prefills
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.request_id in busy:
                i += 1
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.bm.allocate(req, n):
                victim = next(r for r in reversed(self.running) if r.request_id not in busy)
                self.running.remove(victim)      # the most recently admitted idle request
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n,
                                             req.num_computed_tokens + n == req.num_tokens))
                budget -= n
                i += 1
        # 2) waiting requests, unless this step had to preempt
        if not out.preempted:
            budget = self._admit(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.seqs)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Move waiting requests into the batch (FCFS) while budget, sequence cap and blocks
        allow. With prefix caching, a request whose next uncached block is being computed
        right now by another request waits for it (prefix-aware admission) instead of
        computing the same K/V twice; requests behind it may go first."""
        inflight = self._inflight_hashes() if self.bm.enable_prefix_caching else set()
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self.bm.find_cached_prefix(req)
            if len(hits) < len(req.block_hashes) and req.block_hashes[len(hits)] in inflight:
                deferred.append(self.waiting.popleft())
                continue
            remaining = req.num_tokens - len(hits) * self.bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            if not self.bm.allocate(req, n, hits):
                break
            self.waiting.popleft()
            self._start(req)
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens))
            budget -= n
            if self.bm.enable_prefix_caching:
                inflight.update(req.block_hashes[len(hits):])
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _inflight_hashes(self) -> set[int]:
        """Hashes of full prompt blocks that running requests have not finished computing."""
        bs = self.bm.block_size
        return {h for r in self.running for h in r.block_hashes[r.num_computed_tokens // bs:]}

    def _schedule_static(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._release_static_batch_if_done()
        if not self.running:
            while self.waiting and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if not self.bm.allocate(req, req.num_prompt_tokens + req.sampling_params.max_tokens):
                    break
                self.waiting.popleft()
                self._start(req)
        for req in self.running:
            if req.is_finished:                  # padding row: recompute its last position
                if req.num_computed_tokens > 0:  # (none if aborted during its first step)
                    out.seqs.append(ScheduledSeq(req, req.num_computed_tokens - 1, 1, True, padding=True))
            else:
                n = req.num_tokens - req.num_computed_tokens
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n, True))
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.seqs)
        return out

    def _start(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step ------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               logprobs: dict[str, dict[int, float]] | None = None) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled tokens, check
        token-level stops, free finished requests. Returns the requests that got a token."""
        now = time.monotonic()
        changed = []
        for s in out.seqs:
            req = s.req
            if s.padding or req.status != RequestStatus.RUNNING:
                continue                      # padding row, or aborted during the step
            req.num_computed_tokens = s.start + s.num_new_tokens
            if s.sample:
                req.output_token_ids.append(sampled[req.request_id])
                if logprobs and req.request_id in logprobs:
                    req.output_logprobs.append(logprobs[req.request_id])
                if req.first_token_time is None:
                    req.first_token_time = now
                changed.append(req)
                if req.check_stop(self.max_model_len):
                    self.finish(req, req.finish_reason, req.stop_reason)
                    continue
            self.bm.cache_full_blocks(req)
        return changed

    def finish(self, req: Request, reason: FinishReason, stop_reason=None) -> None:
        """End a request now (stop, length, abort): frees its blocks unless static batching
        keeps its row until the batch is done."""
        if req.is_finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.requests.pop(req.request_id, None)
        if req in self.waiting:
            self.waiting.remove(req)
            self.bm.free(req)
        elif self.policy != "static" and req in self.running:
            self.running.remove(req)
            self.bm.cache_full_blocks(req)
            self.bm.free(req)
        elif req in self.running:
            self._release_static_batch_if_done()

    def _release_static_batch_if_done(self) -> None:
        if self.running and all(r.is_finished for r in self.running):
            for r in self.running:               # the batch is done: release its rows
                self.bm.free(r)
            self.running = []
