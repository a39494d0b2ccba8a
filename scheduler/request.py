"""Request and sequence state.

A :class:`Request` is one generation: its prompt token ids, the token ids generated so far,
its sampling parameters and the scheduler's bookkeeping (status, block table, how many of its
tokens already have K/V in the cache). Token ids are Python ints; nothing here touches torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvmesh.core.errors import InvalidRequestError
from kvmesh.core.sampling import SamplingParams


def check_prompt(prompt_token_ids, vocab_size: int) -> None:
    """A prompt from outside: not empty, every id an int in ``[0, vocab_size)``. Raises
    InvalidRequestError. Run once, at the edge that received the request (the scheduler
    service's ``Submit``, or :meth:`scheduler.engine.LLMEngine.add_request` for a direct caller)."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt is empty")
    bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab_size})")


def check_length(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Prompt + ``max_tokens`` within ``max_model_len``: the one max_model_len check of a request
    at each edge (the scheduler service's ``Submit``; :meth:`scheduler.scheduler.Scheduler.add`
    for a request not checked there). Returns the total; raises InvalidRequestError."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(f"prompt ({num_prompt_tokens} tokens) + max_tokens "
                                  f"({max_tokens}) = {total} exceeds max_model_len {max_model_len}")
    return total


class SpecDecodeCounts:
    """Acceptance figures of speculative decoding (docs/spec_decode.md) for a class holding the
    counters ``num_drafts`` (steps that verified proposals), ``num_draft_tokens`` (proposals
    verified) and ``num_accepted_tokens`` (proposals accepted)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified proposals (None when nothing was verified)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per speculative step: accepted proposals + the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens, or max_model_len reached
    ABORT = "abort"      # cancelled by the client, or its deadline passed


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    ``num_computed_tokens`` counts the tokens (prompt then output) whose K/V are already in
    the cache; the scheduler advances it, and resets it to 0 on preemption by recompute.
    ``block_table`` lists the KV block ids that hold this sequence's tokens, in order.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache (first schedule)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of this sequence's full blocks
    num_registered_blocks: int = 0      # leading blocks already offered to the prefix cache
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    traceparent: str | None = None      # W3C trace context of the scheduler's span (tracing on)
    cache_salt: str = ""                # prefix-cache partition: salts the block hashes ("" = none)
    # speculative decoding (docs/spec_decode.md)
    spec_token_ids: list[int] = field(default_factory=list)   # proposals for the next step
    spec_k: int = 0                     # adaptive number of proposals (0: speculation off)
    num_drafts: int = 0                 # steps that verified at least one proposal
    num_draft_tokens: int = 0           # proposals verified
    num_accepted_tokens: int = 0        # of which accepted

    def __post_init__(self) -> None:
        # looked up once per generated token: a set, however long the list
        self.stop_token_id_set = frozenset(self.sampling_params.stop_token_ids)

    def can_speculate(self) -> bool:
        """Whether the next token may be proposed and verified: not with penalties, logprobs
        or before ``min_tokens`` (their per-position distributions depend on the tokens
        before, so a verified run would need them recomputed token by token)."""
        sp = self.sampling_params
        return (self.spec_k > 0 and not sp.has_penalties and sp.logprobs is None
                and self.num_output_tokens >= sp.min_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def check_stop(self, max_model_len: int) -> bool:
        """Set ``finish_reason`` if the last generated token ends the request (token-level
        stops only; stop strings are matched on text by gateway.output_processor). Returns True if
        finished."""
        sp = self.sampling_params
        n = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = FinishReason.STOP, None
                return True
            if last in self.stop_token_id_set:
                self.finish_reason, self.stop_reason = FinishReason.STOP, last
                return True
        if n >= sp.max_tokens or self.num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False
