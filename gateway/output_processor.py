"""The output processor: one request's output on its way to a client, the same for both fronts,
the offline API (:class:`kvmesh.llm.LLM`, :class:`kvmesh.llm.AsyncLLM`) and the gateway
(:class:`gateway.stream.RequestPath`, behind gRPC and the OpenAI-compatible HTTP API).

A front feeds :meth:`OutputProcessor.step` each message its engine (or scheduler) sends for the
request: new token ids, their logprobs, and with the last one the engine's finish reason. Each
call returns an :class:`OutputDelta` for the client:

* text: UTF-8-safe deltas (:class:`gateway.detokenizer.IncrementalDetokenizer`); text that may
  begin a stop string is held back until it completes one or cannot;
* stop strings, matched token by token: one completing inside a message of several tokens
  (speculative decoding) ends the output at that token; the ids and logprobs after it are
  dropped, as their text is. The request finishes with reason ``stop`` and the string as its
  ``stop_reason``; ``end_upstream`` tells the front to end it in the engine, which still runs
  it. No stop string ends in the text of the first ``min_tokens`` tokens (vLLM's rule);
* at the engine's end, the held-back text flushed; a stop string completing in it still makes
  the finish reason ``stop`` (the stop string wins over the engine's reason, as in vLLM);
* usage (:meth:`OutputProcessor.usage`): prompt tokens, completion tokens (the ids kept), and
  the cached prompt tokens and speculative counts the front copied into the metrics;
* timings: :class:`RequestMetrics`, timestamps the front copies in from its engine where it has
  them, the first token and the end stamped on the processor's clock where it has not
  (:meth:`OutputProcessor.timings`).

Cost: O(new ids + new text + longest stop string) per message, so O(output) for the request: the
stop matcher reads each character once, the decoder a bounded window, and the cumulative text is
joined only when read (:attr:`OutputProcessor.text`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.detokenizer import IncrementalDetokenizer
from kvmesh.core.sampling import SamplingParams
from kvmesh.v1 import common_pb2
from scheduler.request import SpecDecodeCounts


@dataclass
class RequestMetrics(SpecDecodeCounts):
    """One request's timestamps, in seconds on the monotonic clock of the process holding it, and
    counts. ``ttft`` is arrival → first token, ``queue_time`` arrival → first scheduled (None while
    unknown). ``num_cached_tokens``: prompt tokens served from the prefix cache. Speculative
    decoding (docs/spec_decode.md): ``num_drafts`` steps verified ``num_draft_tokens``
    proposals, of which ``num_accepted_tokens`` were accepted."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class OutputDelta:
    """What one engine message gives the client.

    ``text``: the new text safe to show (may be ""); ``token_ids``: the message's ids kept (those
    after the token that completed a stop string are dropped); ``logprobs``: theirs, one per kept
    id (empty when none were given); ``finished``: the request ended with this message, with
    ``finish_reason`` (``"stop"``, ``"length"``, ``"abort"``, or what the engine said) and
    ``stop_reason`` (the stop string, the stop token id, None for EOS or another reason);
    ``end_upstream``: a stop string ended it while the engine still runs it, so the front must
    finish it there."""

    text: str
    token_ids: list[int]
    logprobs: list
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    end_upstream: bool = False


class OutputProcessor:
    """The output of one request: feed engine messages to :meth:`step`, read deltas back.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        prompt_token_ids: the prompt (counted in the usage; stop strings never match it).
        params: its sampling parameters (``stop``, ``min_tokens``, ``skip_special_tokens``).
        cumulative: keep the ids and logprobs kept so far (:attr:`token_ids`, :attr:`logprobs`),
            for a front whose updates carry the whole output (the offline API); else only their
            count (the gateway streams deltas).
        arrival_time: when the request arrived, seconds on the monotonic clock; default now.

    Building it costs O(total characters of the stop strings) (their automaton): a front on an
    event loop builds it off the loop.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 cumulative: bool = False, arrival_time: float | None = None):
        self.num_prompt_tokens = len(prompt_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, stop=params.stop,
                                             skip_special_tokens=params.skip_special_tokens,
                                             min_tokens=params.min_tokens)
        self.token_ids: list[int] | None = [] if cumulative else None
        self.logprobs: list | None = [] if cumulative and params.logprobs is not None else None
        self.num_output_tokens = 0          # ids kept
        self.num_chars = 0                  # characters of text given out
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(time.monotonic() if arrival_time is None else arrival_time)

    @property
    def text(self) -> str:
        """All the text given out so far (joined now: O(its length) when it grew)."""
        return self._detok.output_text

    def step(self, token_ids: Sequence[int], logprobs: Sequence = (), *, finished: bool = False,
             finish_reason: str | None = None, stop_reason: int | str | None = None) -> OutputDelta:
        """Fold in one engine message for this request.

        Args:
            token_ids: its new output token ids (may be none).
            logprobs: their logprobs, one entry per id in whatever form the front has (kept as
                given), or empty.
            finished: the engine ended the request with this message, for ``finish_reason``
                (``"stop"``, ``"length"``, ``"abort"``) and ``stop_reason`` (the stop token id;
                None for EOS or another reason).
        Returns:
            The delta (:class:`OutputDelta`). Once the request has finished (a stop string, or
            the engine's end), an empty delta, finished: the engine's later messages are not the
            client's.
        """
        if self.finished:
            return OutputDelta("", [], [], True, self.finish_reason, self.stop_reason)
        now = time.monotonic()
        m = self.metrics
        if token_ids and m.first_token_time is None:
            m.first_token_time = now
        pieces: list[str] = []
        kept, stop = len(token_ids), None
        for i, t in enumerate(token_ids):    # one at a time: a stop string may complete inside
            d = self._detok.add_tokens((t,))
            pieces.append(d.text)
            if d.stop_string is not None:
                kept, stop = i + 1, d.stop_string
                break
        ids = list(token_ids[:kept])
        lps = list(logprobs[:kept])
        end_upstream = stop is not None and not finished
        if stop is None and finished:
            pieces.append(self._detok.flush())
            stop = self._detok.stop_string           # one completing in the flushed text
        if stop is not None:
            finished, finish_reason, stop_reason = True, "stop", stop
        self.num_output_tokens += kept
        if self.token_ids is not None:
            self.token_ids += ids
        if self.logprobs is not None:
            self.logprobs += lps
        text = "".join(pieces)
        self.num_chars += len(text)
        if finished:
            self.finished, self.finish_reason, self.stop_reason = True, finish_reason, stop_reason
            if m.finished_time is None:
                m.finished_time = now
        return OutputDelta(text, ids, lps, finished, self.finish_reason, self.stop_reason, end_upstream)

    def usage(self) -> common_pb2.Usage:
        """Prompt tokens, completion tokens (the ids kept so far), and the cached prompt tokens
        and speculative counts of :attr:`metrics`."""
        m = self.metrics
        return common_pb2.Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.num_output_tokens,
                                cached_prompt_tokens=m.num_cached_tokens, spec_num_drafts=m.num_drafts,
                                spec_num_draft_tokens=m.num_draft_tokens,
                                spec_num_accepted_tokens=m.num_accepted_tokens)

    def timings(self) -> common_pb2.Timings:
        """Durations in seconds from :attr:`metrics`: queue (arrival → first scheduled), ttft
        (arrival → first token), decode (first token → end), e2e (arrival → end); the end is now
        while the request runs; 0 for an event not known (a front that does not see its engine
        schedule the request, a request with no token yet)."""
        m = self.metrics
        end = m.finished_time or time.monotonic()
        first = m.first_token_time
        return common_pb2.Timings(queue_time=m.queue_time or 0.0, ttft=m.ttft or 0.0,
                                  decode_time=end - first if first is not None else 0.0,
                                  e2e_latency=end - m.arrival_time)
