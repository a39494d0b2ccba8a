"""Public Python API: ``LLM`` (offline, batched) and ``AsyncLLM`` (streaming), in the style of
vLLM: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Both wrap the token-level engine (:mod:`scheduler.engine`) with the text layer: the model's
tokenizer and chat template (transformers), and the output processor the gateway uses too
(:mod:`gateway.output_processor`: incremental detokenization, stop strings, finish, usage and
timings).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.output_processor import OutputDelta, OutputProcessor, RequestMetrics
from gateway.text import TextFront, load_tokenizer
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import EngineError, InvalidRequestError
from kvmesh.core.sampling import SamplingParams
from scheduler.async_engine import AsyncEngine
from scheduler.engine import LLMEngine
from scheduler.engine_records import EngineOutput
from scheduler.request import FinishReason


class CompletionOutput:
    """One generated sequence as of one update. ``text``, ``token_ids`` and ``logprobs``
    (None unless asked for) are cumulative: read from the request's output processor up to this
    update when accessed (nothing is built per step; reading them costs their length, or nothing
    for a finished output's). ``delta_text`` and ``delta_token_ids`` hold what is new in this
    update."""

    __slots__ = ("index", "finish_reason", "stop_reason", "delta_text", "delta_token_ids",
                 "_output", "_num_tokens", "_num_chars")

    def __init__(self, index: int, output: OutputProcessor, delta: OutputDelta):
        self.index, self.finish_reason, self.stop_reason = index, delta.finish_reason, delta.stop_reason
        self.delta_text, self.delta_token_ids = delta.text, delta.token_ids
        self._output, self._num_tokens, self._num_chars = output, output.num_output_tokens, output.num_chars

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        text = self._output.text
        return text if len(text) == self._num_chars else text[: self._num_chars]

    @property
    def token_ids(self) -> list[int]:
        ids = self._output.token_ids        # the processor's own list once it can no longer grow
        return ids if self._output.finished and len(ids) == self._num_tokens else ids[: self._num_tokens]

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        lps = self._output.logprobs
        if lps is None or (self._output.finished and len(lps) == self._num_tokens):
            return lps
        return lps[: self._num_tokens]

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


def _step(output: OutputProcessor, o: EngineOutput) -> OutputDelta:
    """Fold the engine's output ``o`` into ``output``: its timestamps and counts (the engine's
    clock is this process's), then its tokens and finish."""
    m = output.metrics
    m.arrival_time = o.arrival_time or m.arrival_time
    m.first_scheduled_time, m.first_token_time, m.finished_time = (o.first_scheduled_time, o.first_token_time,
                                                                   o.finished_time)
    m.num_cached_tokens = o.num_cached_tokens
    m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens = o.num_drafts, o.num_draft_tokens, o.num_accepted_tokens
    return output.step(o.new_token_ids, o.new_logprobs, finished=o.finished,
                       finish_reason=o.finish_reason.value if o.finish_reason else None, stop_reason=o.stop_reason)


def _request_output(request_id: str, prompt: str | None, prompt_ids: list[int], output: OutputProcessor,
                    delta: OutputDelta) -> RequestOutput:
    return RequestOutput(request_id, prompt, prompt_ids, [CompletionOutput(0, output, delta)], delta.finished,
                         output.metrics)


def _engine(model: str, tensor_parallel_size: int, kwargs: dict) -> LLMEngine:
    """The engine of an ``LLM`` / ``AsyncLLM``: the model in this process, or with
    ``tensor_parallel_size`` > 1 its ranks as Ray actors of a local Ray instance
    (:class:`workers.executor.RayPipelineExecutor`)."""
    cfg = EngineConfig.from_env(model=model, **kwargs)
    if tensor_parallel_size == 1:
        return LLMEngine(cfg)
    from kvmesh.core.service_config import SchedulerConfig
    from workers.executor import create_executor
    sc = SchedulerConfig(tensor_parallel_size=tensor_parallel_size)
    return LLMEngine(cfg, executor_factory=lambda c, d: create_executor(c, d, sc))


class LLM(TextFront):
    """Offline batched generation.

    Args:
        model: a known model name (pulled on first use) or a checkpoint directory.
        tensor_parallel_size: ranks each holding 1/N of every layer (Ray actors on this
            machine's local Ray; :mod:`workers.tensor_parallel`); 1 = the model in this process.
        **kwargs: any :class:`kvmesh.core.engine_config.EngineConfig` field (``dtype``, ``policy``,
            ``enable_prefix_caching``, ``kv_cache_memory``, ``max_num_seqs`` ...).
    Raises:
        EngineError: unknown model or unservable settings (head counts ``tensor_parallel_size``
            does not divide, named).
    """

    def __init__(self, model: str = "smollm2-135m-instruct", tensor_parallel_size: int = 1, **kwargs):
        self.engine = _engine(model, tensor_parallel_size, kwargs)
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
        streams: dict[str, tuple[str | None, list[int], OutputProcessor]] = {}
        order = []
        try:
            for p, sp in zip(prompts, params):
                text, ids = self.encode_prompt(p)
                rid = f"llm-{self._counter}"
                self._counter += 1
                req = self.engine.add_request(rid, ids, sp, cache_salt=self.cache_salt_of(p))
                streams[rid] = (text, ids, OutputProcessor(self.tokenizer, ids, sp, cumulative=True,
                                                           arrival_time=req.arrival_time))
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
                text, ids, output = s
                d = _step(output, o)
                if d.end_upstream:
                    self.engine.finish_request(o.request_id, FinishReason.STOP, d.stop_reason)
                if d.finished:
                    results[o.request_id] = _request_output(o.request_id, text, ids, output, d)
                    bar and bar.update(1)
        bar and bar.close()
        return [results[r] for r in order]

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks (those no request holds), as vLLM's
        ``LLM.reset_prefix_cache``: the next prompts are prefilled from scratch. Returns True."""
        self.engine.reset_prefix_cache()
        return True

    def shutdown(self) -> None:
        """Stop the engine's executor (the Ray actors of a tensor-parallel ``LLM``; nothing to
        stop otherwise). The ``LLM`` cannot generate afterwards."""
        self.engine.shutdown()

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (list of messages) or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.encode_chat(c) for c in convs]
        return self.generate(ids, sampling_params, use_tqdm)


class AsyncLLM(TextFront):
    """Streaming generation on a background engine loop. Construct inside an event loop
    (``await AsyncLLM.create(...)``-free: the constructor just needs a running loop)."""

    def __init__(self, model: str = "smollm2-135m-instruct", tensor_parallel_size: int = 1, **kwargs):
        self.engine = AsyncEngine(_engine(model, tensor_parallel_size, kwargs))
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
        output = None
        try:
            async for o in outputs:
                output = output or OutputProcessor(self.tokenizer, ids, params, cumulative=True)
                d = _step(output, o)
                if d.end_upstream:
                    self.engine.finish(o.request_id, FinishReason.STOP, d.stop_reason)
                yield _request_output(o.request_id, text, ids, output, d)
                if d.finished:
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
