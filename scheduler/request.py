"""Request and sequence state, sampling parameters.

A :class:`Request` is one generation: its prompt token ids, the token ids generated so far,
its sampling parameters and the scheduler's bookkeeping (status, block table, how many of its
tokens already have K/V in the cache). Token ids are Python ints; nothing here touches torch.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field


class EngineError(ValueError):
    """A request the engine cannot serve (bad parameters, too long, ...). The message says why."""


class DuplicateRequestError(EngineError):
    """A request id that is already in flight (gRPC: ALREADY_EXISTS)."""


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Defaults follow vLLM: ``temperature=1.0`` samples from the model's distribution; ``0``
    means greedy. ``top_k=-1`` / ``top_p=1.0`` / ``min_p=0.0`` disable those filters.
    Penalties follow the OpenAI definition for presence/frequency (subtracted from the
    logits of tokens already generated) and the CTRL paper (Keskar et al. 2019) for
    repetition (logit divided by it when positive, multiplied when negative, over prompt
    and output tokens).

    Stopping: EOS (unless ``ignore_eos``), any id in ``stop_token_ids``, any string in
    ``stop`` (never included in the output text), or ``max_tokens`` generated tokens.
    No stop condition but ``max_tokens`` applies before ``min_tokens`` tokens exist.
    ``logprobs=n`` returns the n most likely tokens' log-probabilities at every step, plus
    the sampled token's.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`EngineError` naming the first bad field."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise EngineError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise EngineError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise EngineError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise EngineError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise EngineError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise EngineError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise EngineError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is None or self.max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise EngineError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise EngineError("stop strings must be non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise EngineError("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise EngineError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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
        return (self.spec_k > 0 and sp.repetition_penalty == 1.0 and not sp.presence_penalty
                and not sp.frequency_penalty and sp.logprobs is None
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

    def token_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

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
        stops only; stop strings are matched on text by the detokenizer). Returns True if
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
