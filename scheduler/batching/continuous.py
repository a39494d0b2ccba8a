"""Continuous batching: iteration-level scheduling (Orca, Yu et al. 2022 OSDI; vLLM).

Each step fills a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``): running requests first (decodes, and the rest of chunked prefills), then
waiting requests (chunked prefill, prefix-cache hits and blocks of the KV tiers skipped). When KV
blocks run out, the most recently admitted running request is preempted by recompute (its
blocks are freed and it goes back to the front of the queue with its tokens so far), and no
waiting request is admitted in that step.

Speculative decoding (docs/spec_decode.md): a decoding request with proposals
(``Request.spec_token_ids``) runs ``1 + k`` tokens in one step (its last token and ``k``
proposals, ``k`` at most its adaptive ``spec_k``); the ``k`` proposals count against the token
budget and get KV slots. A sampling row asks the runner for ``m`` proposals for its next step
(prompt lookup, the draft, or both: the runner's proposers, ``workers/model_runner.py``); with a
draft model it also gets ``1 + m`` lookahead slots, where the draft writes the new token's and
its own proposals' K/V (vLLM v1's ``num_lookahead_tokens``). After the step,
:meth:`Scheduler.update` rolls back rejected proposals and lookahead slots.

Speculation under load (``speculative_max_batch_tokens`` = B): a verify pass reads the weights
once for all its rows, so it costs about one decode step only while the step's rows stay few;
past about 8 rows a CPU's GEMM is bound by compute and each proposal costs its full share
(docs/spec_decode.md, "Measurements"). Each step therefore caps every row's ``k`` at
``B // n - 1`` for the ``n`` running and waiting requests: a lone request verifies up to
``B - 1`` proposals, a batch of more than ``B / 2`` decodes without speculation (and the draft,
asked for nothing, runs no forward), and speculation comes back as the batch shrinks.
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from kvmesh.core.engine_config import DRAFT_METHODS
from kvmesh.core.errors import CapacityError, SettingsError
from scheduler.request import FinishReason, Request
from scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput


class ContinuousBatching(Scheduler):
    """Args (besides :class:`Scheduler`'s):
        enable_chunked_prefill: split long prompts across steps.
        max_prefill_tokens_with_decodes: with chunked prefill, the most prompt tokens (running
            chunked prefills and admitted requests together) of a step that has a decode row;
            0 = no cap beyond the token budget. A long prompt admitted next to running decodes
            then takes several shorter steps, each giving the decodes a token (the time between
            their tokens, ITL/TPOT, stays near a decode step's), instead of one long step; a
            step without decodes (a cold start) still prefills the whole budget (vLLM's
            ``long_prefill_token_threshold`` caps every step; this caps only the shared ones).
        speculative_method: ``""`` (off), ``ngram``, ``draft`` or ``ngram+draft`` (prompt lookup
            where it matches, the draft where it does not).
        num_speculative_tokens: the most proposals verified per request and step (k).
        speculative_adaptive: adapt each request's k to its acceptance (docs/spec_decode.md).
        speculative_max_batch_tokens: the most tokens (rows x (1 + k)) a step may verify; 0: no
            cap (see the module docstring).
    """

    supports_micro_batches = True

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 2048, enable_chunked_prefill: bool = True,
                 max_prefill_tokens_with_decodes: int = 0, speculative_method: str = "",
                 num_speculative_tokens: int = 0, speculative_adaptive: bool = True,
                 speculative_max_batch_tokens: int = 0):
        super().__init__(block_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         max_model_len=max_model_len)
        self.enable_chunked_prefill = enable_chunked_prefill
        if max_prefill_tokens_with_decodes < 0:
            raise SettingsError(f"max_prefill_tokens_with_decodes must be >= 0, got {max_prefill_tokens_with_decodes}")
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes if enable_chunked_prefill else 0
        self.speculative_method = speculative_method
        self.num_speculative_tokens = num_speculative_tokens if speculative_method else 0
        self._draft = speculative_method in DRAFT_METHODS       # lookahead slots for the draft's K/V
        self.speculative_adaptive = speculative_adaptive
        if speculative_max_batch_tokens < 0:
            raise SettingsError(f"speculative_max_batch_tokens must be >= 0, got {speculative_max_batch_tokens}")
        self.speculative_max_batch_tokens = speculative_max_batch_tokens
        self._k_cap = self.num_speculative_tokens          # this step's cap on k (schedule)
        self._fetched: dict[str, tuple[int, list]] = {}   # waiting request -> (pool hits, its tier blocks)

    def _check_servable(self, req: Request, total: int) -> None:
        if self.enable_chunked_prefill:
            return
        # unchunked, a prompt (or, after a preemption, prompt + output so far) must be
        # prefilled in one step; a longer one would wait forever
        worst = total - 1
        if worst > self.max_num_batched_tokens:
            raise CapacityError(f"prompt ({req.num_prompt_tokens} tokens) + max_tokens "
                                  f"({req.sampling_params.max_tokens}) may need a {worst}-token prefill, over "
                                f"max_num_batched_tokens {self.max_num_batched_tokens} with chunked prefill "
                                f"disabled (enable chunked prefill or raise max_num_batched_tokens)")

    def schedule(self, busy: frozenset[str] | set[str] = frozenset()) -> SchedulerOutput:
        """Running requests (those not ``busy``), then waiting ones unless this step had to preempt."""
        out = SchedulerOutput()
        self._k_cap = self._speculation_cap(busy)
        budget, prefill_left = self._schedule_running(out, busy)
        if not out.preempted:
            self._admit(out, budget, prefill_left)
        out.num_batched_tokens = sum(s.num_scheduled_tokens for s in out.seqs)
        return out

    def _prefill_cap(self, busy) -> int:
        """The prompt tokens this step may prefill: ``max_prefill_tokens_with_decodes`` when a
        running request (not ``busy``) decodes this step, else the whole token budget."""
        cap = self.max_prefill_tokens_with_decodes
        if cap and any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running if r.request_id not in busy):
            return cap
        return self.max_num_batched_tokens

    def _schedule_running(self, out: SchedulerOutput, busy) -> tuple[int, int]:
        """Decodes and unfinished chunked prefills, in admission order, while the budget lasts;
        a request short of blocks preempts the most recently admitted idle one (itself last).
        Returns the budget left and the prompt tokens still allowed (:meth:`_prefill_cap`)."""
        budget = self.max_num_batched_tokens
        prefill_left = self._prefill_cap(busy)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = req.num_tokens - req.num_computed_tokens
            if req.request_id in busy or (left > 1 and prefill_left == 0):
                i += 1
                continue
            n = min(left, budget) if left == 1 else min(left, budget, prefill_left)
            sample = req.num_computed_tokens + n == req.num_tokens
            spec, m = self._speculation(req, n, budget, sample)
            done = bool(spec or m) and self.bm.allocate(req, n + len(spec) + self._lookahead(m))
            if not done:
                spec, m = [], 0                  # no speculation, or short of blocks for it
            while not done and not self.bm.allocate(req, n):
                victim = next(r for r in reversed(self.running) if r.request_id not in busy)
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n, sample, False, spec, m))
                budget -= n + len(spec)
                if left > 1:
                    prefill_left -= n
                i += 1
        return budget, prefill_left

    def _speculation_cap(self, busy) -> int:
        """The most proposals a row may verify (or ask the draft for) this step:
        ``speculative_max_batch_tokens // n - 1``, at least 0, for the ``n`` requests that decode
        this step or soon will (running ones not ``busy``, and waiting ones, up to
        ``max_num_seqs``: the draft's proposals are for the next step); ``num_speculative_tokens``
        without a cap."""
        cap = self.speculative_max_batch_tokens
        if not (cap and self.num_speculative_tokens):
            return self.num_speculative_tokens
        n = sum(1 for r in self.running if r.request_id not in busy) + len(self.waiting)
        return max(0, min(self.num_speculative_tokens, cap // max(min(n, self.max_num_seqs), 1) - 1))

    def _lookahead(self, m: int) -> int:
        """KV slots past a row's tokens and proposals for ``m`` proposals of its next step: the
        new token's and the draft's own (``1 + m``) with a draft model; none for prompt lookup,
        which writes no K/V."""
        return 1 + m if m and self._draft else 0

    def _speculation(self, req: Request, n: int, budget: int, sample: bool) -> tuple[list[int], int]:
        """What a row of ``n`` real tokens of ``req`` speculates this step: the proposals it
        verifies (a decode with proposals; at most ``spec_k``, this step's cap
        (:meth:`_speculation_cap`), the budget left after its own token, and one less than the
        tokens it may still emit) and how many proposals the runner makes for its next step (a
        row that samples; at most ``spec_k``, the cap, and two less than the tokens it may
        still emit: this step's token and the next step's own come on top)."""
        k_cap = self._k_cap
        if not (self.num_speculative_tokens and k_cap and sample and req.can_speculate()):
            return [], 0
        left = min(req.sampling_params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        spec: list[int] = []
        if n == 1:
            k = min(len(req.spec_token_ids), req.spec_k, k_cap, budget - 1, left - 1)
            spec = req.spec_token_ids[:max(k, 0)]
        return spec, max(0, min(req.spec_k, k_cap, left - 2))

    def _admit(self, out: SchedulerOutput, budget: int, prefill_left: int) -> None:
        """Move waiting requests into the batch (FCFS) while budget, the step's prompt tokens
        (``prefill_left``), sequence cap and blocks allow. With prefix caching, a request whose next uncached block is being computed
        right now by another request waits for it (prefix-aware admission) instead of
        computing the same K/V twice; requests behind it may go first."""
        inflight = self._inflight_hashes() if self.bm.enable_prefix_caching else set()
        deferred = []
        while self.waiting and min(budget, prefill_left) > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self.bm.find_cached_prefix(req)
            if len(hits) < len(req.block_hashes) and req.block_hashes[len(hits)] in inflight:
                deferred.append(self.waiting.popleft())
                continue
            loaded = self._from_lower_tiers(req, len(hits))
            remaining = req.num_tokens - (len(hits) + len(loaded)) * self.bm.block_size
            n = min(remaining, budget, prefill_left)
            if n < remaining and not self.enable_chunked_prefill:
                break
            # a prefill that samples may ask for proposals (with a draft model: lookahead slots)
            _, m = self._speculation(req, n, budget, sample=n == remaining)   # (no proposals yet)
            if not (m and self.bm.allocate(req, n + self._lookahead(m), hits, len(loaded))):
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
            prefill_left -= n
            if self.bm.enable_prefix_caching:
                inflight.update(req.block_hashes[len(hits):])
        self.waiting.extendleft(reversed(deferred))

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

    def finish(self, req: Request, reason: FinishReason, stop_reason=None) -> None:
        self._fetched.pop(req.request_id, None)
        super().finish(req, reason, stop_reason)
