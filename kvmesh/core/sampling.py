"""Sampling parameters: how a request picks each next token and when it stops (vLLM's names).

Used by every layer (the LLM API, the gateway, the scheduler, the workers' sampler); the proto
form is ``kvmesh.v1.SamplingParams`` (:mod:`kvmesh.core.proto` converts).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields

from kvmesh.core.errors import InvalidRequestError


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

    @classmethod
    def trusted(cls, **values) -> "SamplingParams":
        """Build without validating: for an internal hop that carries values an edge has already
        validated (the scheduler service's ``Submit`` → its replica's engine process). Fields not
        given take their defaults. Never for values from outside a trust boundary: the public
        constructor (which validates) is for those. Raises TypeError for an unknown field."""
        obj = cls.__new__(cls)
        for f in fields(cls):
            if f.name in values:
                v = values.pop(f.name)
            else:
                v = f.default_factory() if f.default is MISSING else f.default
            setattr(obj, f.name, v)
        if values:
            raise TypeError(f"unknown SamplingParams field(s): {', '.join(sorted(values))}")
        obj.stop, obj.stop_token_ids = list(obj.stop), list(obj.stop_token_ids)
        return obj

    def validate(self) -> None:
        """Raise :class:`~kvmesh.core.errors.InvalidRequestError` naming the first bad field."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidRequestError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequestError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequestError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is None or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the token history (repetition: prompt and output; presence
        and frequency: output), so each next token's distribution depends on the tokens before."""
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)
