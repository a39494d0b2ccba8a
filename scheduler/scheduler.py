"""The scheduler of one replica: its waiting and running queues over its block manager, and the
plan of each model step (:class:`SchedulerOutput`).

:class:`Scheduler` holds what every batching policy shares: admission checks (:meth:`~Scheduler.add`),
applying a step's results (:meth:`~Scheduler.update`: new tokens, token-level stops, the roll-back
of rejected speculative proposals) and ending requests (:meth:`~Scheduler.finish`). A policy
(:mod:`scheduler.batching`, chosen once from ``EngineConfig.policy``) decides each step's batch in
:meth:`~Scheduler.schedule`:

- ``continuous`` (:mod:`scheduler.batching.continuous`): iteration-level scheduling with a token
  budget, chunked prefill, prefix-aware admission, preemption by recompute and speculative
  decoding;
- ``static`` (:mod:`scheduler.batching.static`): a whole batch at a time, padded rows;
- ``naive`` (:mod:`scheduler.batching.naive`): one request at a time, no KV reuse.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvmesh.core.errors import CapacityError, DuplicateRequestError
from scheduler.block_manager import BlockManager
from scheduler.request import FinishReason, Request, RequestStatus, check_length


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
    """Owns the waiting and running queues and the block manager of one replica; subclasses
    (the batching policies) implement :meth:`schedule`. Build one with
    :func:`scheduler.batching.make_scheduler`.

    Args:
        block_manager: the replica's KV block accounting.
        max_num_seqs: cap on running sequences.
        max_num_batched_tokens: token budget per step (where the policy has one).
        max_model_len: longest sequence (prompt + output) in tokens.

    Attributes:
        supports_micro_batches: :meth:`schedule` leaves out the requests of micro-batches still
            in flight (``busy``), so that several run at once (pipeline parallelism).
        num_speculative_tokens: the most proposals verified per request and step (0: off; set
            by the continuous policy).
        tiers: the KV tiers below the pool (:class:`kvstore.tiers.KVTiers`; the engine sets it).
    """

    supports_micro_batches = False

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 2048):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_speculative_tokens = 0
        self.speculative_adaptive = False
        self.tiers = None

    # ---- admission -------------------------------------------------------------------
    def add(self, req: Request, validated: bool = False) -> None:
        """Queue a request. Raises DuplicateRequestError for an id in use, InvalidRequestError if
        it can never fit ``max_model_len`` (not checked again when ``validated``: the edge that
        received it checked it, :func:`scheduler.request.check_length`), CapacityError if this
        replica can never hold it (KV pool, unchunked prefill budget)."""
        if req.request_id in self.requests:
            raise DuplicateRequestError(f"duplicate request id {req.request_id!r}")
        total = req.num_prompt_tokens + req.sampling_params.max_tokens
        if not validated:
            check_length(req.num_prompt_tokens, req.sampling_params.max_tokens, self.max_model_len)
        if self.bm.blocks_needed(total) > self.bm.num_blocks:
            raise CapacityError(f"request needs {self.bm.blocks_needed(total)} KV blocks of {self.bm.block_size} tokens; "
                                f"the whole pool has {self.bm.num_blocks} (raise --kv-cache-memory)")
        self._check_servable(req, total)
        req.spec_k = self.num_speculative_tokens
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _check_servable(self, req: Request, total: int) -> None:
        """The policy's own admission check of a request of ``total`` tokens at most (prompt +
        max_tokens). Raises CapacityError."""

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self, busy: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        """The next step. ``busy``: ids of running requests whose previous micro-batch is still
        in flight (only with :attr:`supports_micro_batches`)."""
        raise NotImplementedError

    def _start(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.running.append(req)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Preempt a running request by recompute: its blocks are freed and it goes back to the
        front of the queue with its tokens so far."""
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)

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
        """End a request now (stop, length, abort) and free its blocks. Idempotent."""
        if req.is_finished:
            return
        self._mark_finished(req, reason, stop_reason)
        if req in self.waiting:
            self.waiting.remove(req)
            self.bm.free(req)
        elif req in self.running:
            self.running.remove(req)
            self.bm.cache_full_blocks(req)
            self.bm.free(req)

    def _mark_finished(self, req: Request, reason: FinishReason, stop_reason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.requests.pop(req.request_id, None)
