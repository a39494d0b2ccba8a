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

Speculative decoding (continuous policy only; docs/spec_decode.md): a decoding request with
proposals (``Request.spec_token_ids``) runs ``1 + k`` tokens in one step (its last token and
``k`` proposals, ``k`` at most its adaptive ``spec_k``); the ``k`` proposals count against the
token budget and get KV slots. With a draft model, a sampling row that asks the draft for ``m``
proposals also gets ``1 + m`` lookahead slots (vLLM v1's ``num_lookahead_tokens``). After the
step, rejected proposals and lookahead slots are rolled back: ``num_computed_tokens`` excludes
them and the blocks no longer needed return to the pool.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvmesh.core.errors import CapacityError, DuplicateRequestError, InvalidRequestError, SettingsError
from scheduler.block_manager import BlockManager
from scheduler.request import FinishReason, Request, RequestStatus

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
    spec_token_ids: list[int] = field(default_factory=list)   # proposals verified this step
    num_proposals: int = 0    # draft proposals asked for the next step (draft method)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens through the model this step: the real ones and the proposals."""
        return self.num_new_tokens + len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    # KV tiers: blocks to fill before this step: (block ids, kvstore.tiers.FetchedBlock each)
    kv_loads: list[tuple[list[int], list]] = field(default_factory=list)

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
        speculative_method: ``""`` (off), ``ngram`` or ``draft`` (continuous policy only).
        num_speculative_tokens: the most proposals verified per request and step (k).
        speculative_adaptive: adapt each request's k to its acceptance (docs/spec_decode.md).
    Raises:
        SettingsError: unknown policy, or speculation under a policy other than ``continuous``.
    """

    def __init__(self, block_manager: BlockManager, *, policy: str = "continuous", max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int = 2048,
                 enable_chunked_prefill: bool = True, speculative_method: str = "",
                 num_speculative_tokens: int = 0, speculative_adaptive: bool = True):
        if policy not in POLICIES:
            raise SettingsError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
        if speculative_method and policy != "continuous":
            raise SettingsError(f"speculative_method {speculative_method!r} needs policy 'continuous' "
                                f"(got {policy!r})")
        self.speculative_method = speculative_method
        self.num_speculative_tokens = num_speculative_tokens if speculative_method else 0
        self.speculative_adaptive = speculative_adaptive
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
        self.tiers = None        # kvstore.tiers.KVTiers below the pool (the engine sets it)
        self._fetched: dict[str, tuple[int, list]] = {}   # waiting request -> (pool hits, its tier blocks)

    # ---- admission -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request. Raises InvalidRequestError if it can never fit ``max_model_len``,
        CapacityError if this replica can never hold it (KV pool, unchunked prefill budget)."""
        if req.request_id in self.requests:
            raise DuplicateRequestError(f"duplicate request id {req.request_id!r}")
        total = req.num_prompt_tokens + req.sampling_params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                                      f"({req.sampling_params.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}")
        if self.bm.blocks_needed(total) > self.bm.num_blocks:
            raise CapacityError(f"request needs {self.bm.blocks_needed(total)} KV blocks of {self.bm.block_size} tokens; "
                                f"the whole pool has {self.bm.num_blocks} (raise --kv-cache-memory)")
        if self.policy == "continuous" and not self.enable_chunked_prefill:
            # unchunked, a prompt (or, after a preemption, prompt + output so far) must be
            # prefilled in one step; a longer one would wait forever
            worst = total - 1
            if worst > self.max_num_batched_tokens:
                raise CapacityError(f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                                    f"({req.sampling_params.max_tokens}) may need a {worst}-token prefill, over "
                                    f"max_num_batched_tokens {self.max_num_batched_tokens} with chunked prefill "
                                    f"disabled (enable chunked prefill or raise max_num_batched_tokens)")
        req.spec_k = self.num_speculative_tokens
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
            sample = req.num_computed_tokens + n == req.num_tokens
            spec, m = self._speculation(req, n, budget, sample)
            done = bool(spec or m) and self.bm.allocate(req, n + len(spec) + (1 + m if m else 0))
            if not done:
                spec, m = [], 0                  # no speculation, or short of blocks for it
            while not done and not self.bm.allocate(req, n):
                victim = next(r for r in reversed(self.running) if r.request_id not in busy)
                self.running.remove(victim)      # the most recently admitted idle request
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n, sample, False, spec, m))
                budget -= n + len(spec)
                i += 1
        # 2) waiting requests, unless this step had to preempt
        if not out.preempted:
            budget = self._admit(out, budget)
        out.num_batched_tokens = sum(s.num_scheduled_tokens for s in out.seqs)
        return out

    def _speculation(self, req: Request, n: int, budget: int, sample: bool) -> tuple[list[int], int]:
        """What a row of ``n`` real tokens of ``req`` speculates this step: the proposals it
        verifies (a decode with proposals; at most ``spec_k``, the budget left after its own
        token, and one less than the tokens it may still emit) and, with a draft model, how
        many proposals the draft makes for its next step (a row that samples)."""
        if not (self.num_speculative_tokens and sample and req.can_speculate()):
            return [], 0
        left = min(req.sampling_params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        spec: list[int] = []
        if n == 1:
            k = min(len(req.spec_token_ids), req.spec_k, budget - 1, left - 1)
            spec = req.spec_token_ids[:max(k, 0)]
        m = 0
        if self.speculative_method == "draft":
            m = max(0, min(req.spec_k, left - 2))
        return spec, m

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
            loaded = self._from_lower_tiers(req, len(hits))
            remaining = req.num_tokens - (len(hits) + len(loaded)) * self.bm.block_size
            n = min(remaining, budget)
            if n < remaining and not self.enable_chunked_prefill:
                break
            # a prefill that samples may ask the draft for proposals (lookahead slots)
            _, m = self._speculation(req, n, budget, sample=n == remaining)   # (no proposals yet)
            if not (m and self.bm.allocate(req, n + 1 + m, hits, len(loaded))):
                m = 0
                if not self.bm.allocate(req, n, hits, len(loaded)):
                    break
            self._fetched.pop(req.request_id, None)
            if loaded:
                out.kv_loads.append((req.block_table[len(hits):len(hits) + len(loaded)], loaded))
                self.tiers.count_loaded(loaded)
            self.waiting.popleft()
            self._start(req)
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens,
                                         num_proposals=m))
            budget -= n
            if self.bm.enable_prefix_caching:
                inflight.update(req.block_hashes[len(hits):])
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _from_lower_tiers(self, req: Request, num_hits: int) -> list:
        """The blocks (:class:`kvstore.tiers.FetchedBlock`) after the request's ``num_hits`` pool
        hits that a KV tier below the pool holds (leading ones only; at least one token is
        left to compute)."""
        if self.tiers is None or not self.bm.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.bm.block_size
        if num_hits >= max_blocks:
            return []
        prev = self._fetched.get(req.request_id)
        if prev is not None and prev[0] == num_hits:      # still waiting for blocks: no new look-up
            return prev[1]
        found = self.tiers.fetch(req.block_hashes[num_hits:max_blocks])
        if found:
            self._fetched[req.request_id] = (num_hits, found)
        return found

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
        out.num_batched_tokens = sum(s.num_scheduled_tokens for s in out.seqs)
        return out

    def _start(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step ------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]],
               logprobs: dict[str, dict[int, float]] | None = None) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled tokens, check
        token-level stops, free finished requests. Returns the requests that got a token.

        ``sampled[id]`` holds a sampling row's new tokens: its accepted proposals, then the
        target's own token (one token without speculation). Tokens after a stop (EOS, a stop
        token id, ``max_tokens``, ``max_model_len``) are dropped. Rejected proposals are rolled
        back: ``num_computed_tokens`` counts the accepted ones only, and blocks past the
        sequence's tokens (rejected proposals, draft lookahead) go back to the pool."""
        now = time.monotonic()
        changed = []
        for s in out.seqs:
            req = s.req
            if s.padding or req.status != RequestStatus.RUNNING:
                continue                      # padding row, or aborted during the step
            req.num_computed_tokens = s.start + s.num_new_tokens
            if s.sample:
                new = sampled[req.request_id]
                k, accepted = len(s.spec_token_ids), len(new) - 1
                req.num_computed_tokens += accepted        # accepted proposals have valid K/V
                req.spec_token_ids = []                    # the engine sets the next ones
                if k:
                    self._record_speculation(req, k, accepted)
                if logprobs and req.request_id in logprobs:
                    req.output_logprobs.append(logprobs[req.request_id])
                if req.first_token_time is None:
                    req.first_token_time = now
                changed.append(req)
                stopped = False
                for t in new:
                    req.output_token_ids.append(t)
                    if req.check_stop(self.max_model_len):
                        stopped = True
                        break
                if stopped:
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                    self.finish(req, req.finish_reason, req.stop_reason)
                    continue
                if k or s.num_proposals:
                    self.bm.trim(req, req.num_tokens)
            self.bm.cache_full_blocks(req)
        return changed

    def _record_speculation(self, req: Request, k: int, accepted: int) -> None:
        """Acceptance counters, and the adaptive k rule: all ``k`` proposals accepted → ``spec_k``
        + 1; fewer than half accepted → ``spec_k`` - 1; within ``[1, num_speculative_tokens]``."""
        req.num_drafts += 1
        req.num_draft_tokens += k
        req.num_accepted_tokens += accepted
        if self.speculative_adaptive:
            if accepted == k:
                req.spec_k = min(req.spec_k + 1, self.num_speculative_tokens)
            elif 2 * accepted < k:
                req.spec_k = max(req.spec_k - 1, 1)

    def finish(self, req: Request, reason: FinishReason, stop_reason=None) -> None:
        """End a request now (stop, length, abort): frees its blocks unless static batching
        keeps its row until the batch is done."""
        if req.is_finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.requests.pop(req.request_id, None)
        self._fetched.pop(req.request_id, None)
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
