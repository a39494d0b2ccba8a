"""Public Python API: ``LLM`` (offline, batched) and ``AsyncLLM`` (streaming), in the style of
vLLM: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Both wrap the token-level engine (:mod:`scheduler.engine`) with the text layer: the model's
tokenizer and chat template (transformers), incremental detokenization and stop strings
(:mod:`gateway.detokenizer`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.detokenizer import IncrementalDetokenizer
from gateway.text import TextFront, load_tokenizer
from kvmesh.core.config import EngineConfig
from kvmesh.core.errors import EngineError, InvalidRequestError
from kvmesh.core.sampling import SamplingParams
from scheduler.async_engine import AsyncEngine
from scheduler.engine import EngineOutput, LLMEngine
from scheduler.request import FinishReason, SpecDecodeCounts


@dataclass
class CompletionOutput:
    """One generated sequence. ``text``/``token_ids`` are cumulative; ``delta_text`` and
    ``delta_token_ids`` hold what is new in this streamed update."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics(SpecDecodeCounts):
    """Seconds on the monotonic clock; ``ttft`` is arrival → first token. Speculative
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
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


class _TextStream:
    """Text state of one request: detokenizer, stop strings, cumulative output."""

    def __init__(self, tokenizer, request_id: str, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=params.stop,
                                            skip_special_tokens=params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.metrics = RequestMetrics(time.monotonic())

    def apply(self, o: EngineOutput) -> tuple[RequestOutput, str | None]:
        """Fold an engine output in. Returns the update and the stop string that matched now
        (the caller must then finish the request in the engine)."""
        delta_ids = [] if self.finish_reason else list(o.new_token_ids)
        # token by token: a step may bring several (speculative decoding), and a stop string
        # completing inside them ends the output at that token
        delta, stop_hit = "", None
        for i, t in enumerate(delta_ids):
            d = self.detok.add_tokens([t])
            delta += d.text
            if d.stop_string is not None:
                stop_hit, delta_ids = d.stop_string, delta_ids[: i + 1]
                break
        self.token_ids += delta_ids
        if self.params.logprobs is not None:
            self.logprobs += o.new_logprobs
        if stop_hit is not None:
            self.finish_reason, self.stop_reason = FinishReason.STOP.value, stop_hit
        elif o.finished and self.finish_reason is None:
            delta += self.detok.flush()
            self.finish_reason = o.finish_reason.value if o.finish_reason else None
            self.stop_reason = o.stop_reason
        self.text += delta
        m = self.metrics
        m.arrival_time = o.arrival_time or m.arrival_time
        m.first_scheduled_time, m.first_token_time = o.first_scheduled_time, o.first_token_time
        m.num_cached_tokens = o.num_cached_tokens
        m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens = o.num_drafts, o.num_draft_tokens, o.num_accepted_tokens
        if self.finish_reason is not None:
            m.finished_time = o.finished_time or time.monotonic()
        comp = CompletionOutput(0, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
                                self.logprobs if self.params.logprobs is not None else None, delta, delta_ids)
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, [comp],
                             self.finish_reason is not None, m), stop_hit


class LLM(TextFront):
    """Offline batched generation.

    Args:
        model: a known model name (pulled on first use) or a checkpoint directory.
        **kwargs: any :class:`kvmesh.core.config.EngineConfig` field (``dtype``, ``policy``,
            ``enable_prefix_caching``, ``kv_cache_memory``, ``max_num_seqs`` ...).
    Raises:
        EngineError: unknown model or unservable settings.
    """

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs):
        self.engine = LLMEngine(EngineConfig.from_env(model=model, **kwargs))
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._counter = 0

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or dicts) and return outputs in prompt
        order. A dict prompt (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``) may carry a
        ``cache_salt`` (:meth:`cache_salt_of`). Each request is validated before any runs
        (EngineError names the bad one)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        streams: dict[str, _TextStream] = {}
        order = []
        try:
            for p, sp in zip(prompts, params):
                text, ids = self.encode_prompt(p)
                rid = f"llm-{self._counter}"
                self._counter += 1
                req = self.engine.add_request(rid, ids, sp, cache_salt=self.cache_salt_of(p))
                streams[rid] = _TextStream(self.tokenizer, rid, text, ids, sp)
                streams[rid].metrics.arrival_time = req.arrival_time
                order.append(rid)
        except EngineError:
            for rid in order:
                self.engine.abort_request(rid)
            self.engine.step()          # collect the aborts
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc="generate", unit="req")
        while len(results) < len(order):
            for o in self.engine.step():
                s = streams.get(o.request_id)
                if s is None or o.request_id in results:
                    continue
                ro, stop_hit = s.apply(o)
                if stop_hit is not None:
                    self.engine.finish_request(o.request_id, FinishReason.STOP, stop_hit)
                if ro.finished:
                    results[o.request_id] = ro
                    bar and bar.update(1)
        bar and bar.close()
        return [results[r] for r in order]

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks (those no request holds), as vLLM's
        ``LLM.reset_prefix_cache``: the next prompts are prefilled from scratch. Returns True."""
        self.engine.reset_prefix_cache()
        return True

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (list of messages) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.encode_chat(c) for c in convs]
        return self.generate(ids, sampling_params, use_tqdm)


class AsyncLLM(TextFront):
    """Streaming generation on a background engine loop. Construct inside an event loop
    (``await AsyncLLM.create(...)``-free: the constructor just needs a running loop)."""

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs):
        self.engine = AsyncEngine(LLMEngine(EngineConfig.from_env(model=model, **kwargs)))
        self.tokenizer = load_tokenizer(self.engine.engine.model_dir)

    async def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None
                          ) -> AsyncIterator[RequestOutput]:
        """Stream updates (``.outputs[0].delta_text``) until the request finishes. Breaking
        out of the iteration aborts the request. ``prompt`` as in :meth:`LLM.generate` (a dict
        may carry a ``cache_salt``). Raises EngineError for a bad request."""
        params = params or SamplingParams()
        text, ids = self.encode_prompt(prompt)
        # aborts the request if we stop early
        outputs = self.engine.generate(request_id, ids, params, cache_salt=self.cache_salt_of(prompt))
        stream = None
        try:
            async for o in outputs:
                stream = stream or _TextStream(self.tokenizer, o.request_id, text, ids, params)
                ro, stop_hit = stream.apply(o)
                if stop_hit is not None:
                    self.engine.finish(o.request_id, FinishReason.STOP, stop_hit)
                yield ro
                if ro.finished:
                    return
        finally:
            await outputs.aclose()

    generate = add_request

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        """As :meth:`LLM.reset_prefix_cache`; requests in flight keep their blocks."""
        self.engine.engine.reset_prefix_cache()
        return True

    async def shutdown(self) -> None:
        await self.engine.shutdown()
