"""The engine loop of one replica: schedule → execute → update, and its async API.

:class:`LLMEngine` is token-level and synchronous (``step()`` runs one model step);
:class:`AsyncEngine` runs that loop on a background thread and streams
:class:`EngineOutput` objects to asyncio callers, in the manner of vLLM's engine core and
AsyncLLM. Text (tokenization, detokenization, stop strings) lives above, in
:mod:`kvmesh.llm` and the gateway.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvmesh.config import EngineConfig
from kvstore.events import KVEventSink
from kvstore.hashing import seed_hash
from scheduler.block_manager import BlockManager, BlockStats
from scheduler.request import EngineError, FinishReason, Request, RequestStatus, SamplingParams, SpecDecodeCounts
from scheduler.scheduler import Scheduler, SchedulerOutput


@dataclass
class EngineOutput(SpecDecodeCounts):
    """What one step produced for one request. Times are seconds (monotonic clock)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding, cumulative over the request (docs/spec_decode.md)
    num_drafts: int = 0               # steps that verified proposals
    num_draft_tokens: int = 0         # proposals verified
    num_accepted_tokens: int = 0      # proposals accepted


def model_identity(model_dir: Path, name: str, cfg: EngineConfig, kv_dtype: torch.dtype) -> str:
    """Stable identity of the KV contents: model (name, or directory name + config digest),
    weight dtype/format (with int4 group size and calibration, workers.quant.store.weight_identity)
    and KV dtype. Seeds the prefix-cache block hashes."""
    from workers.quant.store import weight_identity
    digest = xxhash.xxh3_64_hexdigest((model_dir / "config.json").read_bytes())
    wf = weight_identity(cfg.weight_format, cfg.quant_group_size, cfg.enable_calibration, cfg.calibration_data)
    weights = f"{cfg.torch_dtype}" + ("" if wf == "none" else f"/{wf}")
    return f"model={name}:{digest};weights={weights};kv={kv_dtype}"


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json and config.json (either may list several)."""
    ids: list[int] = []
    for fname in ("generation_config.json", "config.json"):
        p = model_dir / fname
        if p.is_file():
            v = json.loads(p.read_text()).get("eos_token_id")
            ids += v if isinstance(v, list) else ([v] if v is not None else [])
    return tuple(dict.fromkeys(ids))


class LLMEngine:
    """One replica: a scheduler, its block manager and an executor.

    Thread-safety: ``add_request``, ``abort_request`` and ``finish_request`` may be called
    from other threads while ``step()`` runs; the model executes outside the lock.

    Args:
        cfg: engine settings.
        executor: an Executor to use as is (tests share one between engines).
        executor_factory: ``(cfg, model_dir) -> Executor``, called once the settings are
            resolved (e.g. a Ray pipeline, :func:`workers.executor.create_executor`);
            default: the model in this process.
        kv_event_sink: receives the block manager's KV events.
        num_blocks: KV pool size for the default executor (None: from ``cfg.kv_cache_memory``).
    Raises:
        EngineError: unknown model, unservable checkpoint, bad settings.
    """

    def __init__(self, cfg: EngineConfig, *, executor=None, executor_factory=None,
                 kv_event_sink: KVEventSink | None = None, num_blocks: int | None = None):
        from workers.registry import resolve_model   # a known name is pulled on first use
        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        from workers.loader import load_config
        mcfg = load_config(self.model_dir)
        limit = min(mcfg.max_position_embeddings, 8192)
        if cfg.max_model_len > mcfg.max_position_embeddings:
            raise EngineError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                              f"max_position_embeddings {mcfg.max_position_embeddings}")
        self.cfg = cfg = cfg.replace(max_model_len=cfg.max_model_len or limit)
        self.model_config = mcfg
        if executor is None and executor_factory is not None:
            executor = executor_factory(cfg, str(self.model_dir))
        if executor is None:
            from workers.executor import InProcessExecutor
            executor = InProcessExecutor(cfg, str(self.model_dir), num_blocks)
        self.executor = executor
        self.eos_token_ids = eos_token_ids(self.model_dir)
        from workers.kv_cache import kv_dtype
        self.identity = model_identity(self.model_dir, cfg.model, cfg, kv_dtype(cfg.kv_cache_dtype, cfg.torch_dtype))
        self.block_manager = BlockManager(executor.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                          seed_hash(self.identity), kv_event_sink)
        self.scheduler = Scheduler(self.block_manager, policy=cfg.policy, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=max(cfg.max_num_batched_tokens, 1),
                                   max_model_len=cfg.max_model_len,
                                   enable_chunked_prefill=cfg.enable_chunked_prefill,
                                   speculative_method=cfg.speculative_method,
                                   num_speculative_tokens=cfg.num_speculative_tokens,
                                   speculative_adaptive=cfg.speculative_adaptive)
        self.lock = threading.RLock()
        self._emitted: dict[str, int] = {}
        self._finished_out: list[EngineOutput] = []
        self._in_flight: set[str] = set()       # ids of the requests in submitted micro-batches
        self._deferred: dict[str, tuple[FinishReason, int | str | None]] = {}
        self.num_steps = 0
        self.spec_propose_seconds = 0.0          # time spent proposing (ngram here, draft in the runner)

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    traceparent: str | None = None) -> Request:
        """Queue a request. Raises EngineError (empty prompt, token id out of range, too
        long for max_model_len or for the whole KV pool, duplicate id). ``traceparent``: W3C
        trace context handed to the workers with the request's steps (kvmesh/telemetry.py)."""
        params = params or SamplingParams()
        params.validate()
        if not prompt_token_ids:
            raise EngineError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise EngineError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        req = Request(request_id or uuid.uuid4().hex, list(prompt_token_ids), params, self.eos_token_ids,
                      arrival_time=arrival_time or time.monotonic(), traceparent=traceparent)
        with self.lock:
            self.scheduler.add(req)
            self._emitted[req.request_id] = 0
        return req

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request; its blocks are freed at once. False if it is unknown/finished."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason=None) -> bool:
        """End a request. One that the model is computing right now (a call from another
        thread during ``step()``) is ended as soon as the model returns: until then the
        executor still reads its block table."""
        with self.lock:
            req = self.scheduler.requests.get(request_id)
            if req is None:
                return False
            if request_id in self._in_flight:
                self._deferred.setdefault(request_id, (reason, stop_reason))
                return True
            self._finish_now(req, reason, stop_reason)
            return True

    def _finish_now(self, req: Request, reason: FinishReason, stop_reason) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        self._finished_out.append(self._output(req))
        self.executor.free_requests([req.request_id])

    def has_unfinished_requests(self) -> bool:
        with self.lock:
            return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Unfinished requests, or ended ones whose final outputs ``step()`` has yet to return."""
        with self.lock:
            return self.scheduler.has_unfinished() or bool(self._finished_out)

    def stats(self) -> BlockStats:
        with self.lock:
            return self.block_manager.stats()

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule, run the model once, apply the results. Returns the outputs of requests
        that produced tokens or finished in this step (including aborts since the last step)."""
        step = self.submit_step()
        if step is None:
            return self.take_finished()
        return self.complete_step(step)

    @property
    def max_inflight(self) -> int:
        """Micro-batches that may be in flight at once: the executor's pipeline depth under
        continuous batching, else 1."""
        return getattr(self.executor, "max_inflight", 1) if self.cfg.policy == "continuous" else 1

    def submit_step(self) -> "InFlightStep | None":
        """Schedule a micro-batch of the requests not already in flight and start it on the
        executor. None when there is nothing to run."""
        with self.lock, torch.profiler.record_function("schedule"):
            sched = self.scheduler.schedule(busy=self._in_flight)
            if sched.empty:
                return None
            ids = {s.req.request_id for s in sched.seqs}
            self._in_flight |= ids
        try:
            handle = self.executor.submit(sched)
        except BaseException:
            self._settle(ids)
            raise
        return InFlightStep(sched, ids, handle)

    def complete_step(self, step: "InFlightStep") -> list[EngineOutput]:
        """Wait for a submitted micro-batch and apply its results (in submission order)."""
        try:
            result = step.handle.result()
        finally:
            self._settle(step.request_ids)
        with self.lock, torch.profiler.record_function("update"):
            self.num_steps += 1
            changed = self.scheduler.update(step.sched, result.sampled, result.logprobs)
            if self.cfg.speculative_method:
                self._set_proposals(changed, result)
            outputs, self._finished_out = self._finished_out, []
            outputs += [self._output(r) for r in changed]
            done = [o.request_id for o in outputs if o.finished]
            self.block_manager.take_events()
        if done:
            self.executor.free_requests(done)
        return outputs

    def _set_proposals(self, changed: list[Request], result) -> None:
        """The next step's proposals of the requests that just got tokens: prompt lookup over
        their tokens (``ngram``), or the draft's, which came back with this step's output."""
        if self.cfg.speculative_method == "ngram":
            from workers.spec_decode.ngram import propose_ngram
            t0 = time.perf_counter()
            for r in changed:
                if not r.is_finished and r.can_speculate():
                    r.spec_token_ids = propose_ngram(r.all_token_ids, r.spec_k, self.cfg.prompt_lookup_max,
                                                     self.cfg.prompt_lookup_min)
            self.spec_propose_seconds += time.perf_counter() - t0
            return
        self.spec_propose_seconds += result.propose_seconds
        for rid, toks in result.proposals.items():
            r = self.scheduler.requests.get(rid)
            if r is not None and r.status == RequestStatus.RUNNING and r.can_speculate():
                r.spec_token_ids = list(toks)

    def take_finished(self) -> list[EngineOutput]:
        """Outputs of requests ended outside a step (aborts) since the last call."""
        with self.lock:
            out, self._finished_out = self._finished_out, []
            self.block_manager.take_events()
        return out

    def _settle(self, request_ids: set[str]) -> None:
        """A micro-batch is back: its requests leave the in-flight set, and the ones ended
        while it ran (deferred aborts and finishes) end now."""
        with self.lock:
            self._in_flight -= request_ids
            for rid in request_ids & self._deferred.keys():
                reason, stop_reason = self._deferred.pop(rid)
                req = self.scheduler.requests.get(rid)
                if req is not None:
                    self._finish_now(req, reason, stop_reason)

    def _output(self, req: Request) -> EngineOutput:
        start = self._emitted.get(req.request_id, 0)
        self._emitted[req.request_id] = req.num_output_tokens
        finished = req.is_finished
        if finished:
            self._emitted.pop(req.request_id, None)
        return EngineOutput(
            req.request_id, req.output_token_ids[start:], req.output_logprobs[start:], finished,
            req.finish_reason, req.stop_reason, req.num_prompt_tokens, req.num_cached_tokens,
            req.num_output_tokens, req.arrival_time, req.first_scheduled_time, req.first_token_time,
            time.monotonic() if finished else None, req.num_drafts, req.num_draft_tokens, req.num_accepted_tokens)

    def shutdown(self) -> None:
        self.executor.shutdown()


@dataclass
class InFlightStep:
    """A micro-batch submitted to the executor and not yet applied."""

    sched: SchedulerOutput
    request_ids: set[str]
    handle: object          # has .result() -> ModelRunnerOutput


class AsyncEngine:
    """Runs an :class:`LLMEngine`'s loop on a background thread; asyncio callers stream
    outputs per request. Create it inside a running event loop."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._stop = False
        self.errored: BaseException | None = None
        # called on the event loop with each batch of outputs before they are delivered (metrics)
        self.on_outputs = None
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    def add_request(self, request_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, traceparent: str | None = None
                    ) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns its id and the queue its :class:`EngineOutput`s arrive on.
        Raises EngineError at once for a request that cannot be served."""
        if self.errored is not None:
            raise EngineError(f"engine loop died: {self.errored!r}")
        q: asyncio.Queue = asyncio.Queue()
        req = self.engine.add_request(request_id, prompt_token_ids, params, traceparent=traceparent)
        self._queues[req.request_id] = q
        self._wake.set()
        return req.request_id, q

    async def generate(self, request_id: str | None, prompt_token_ids: list[int],
                       params: SamplingParams | None = None, traceparent: str | None = None
                       ) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs; aborts it if the consumer stops early."""
        rid, q = self.add_request(request_id, prompt_token_ids, params, traceparent)
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    return
        finally:
            if self._queues.pop(rid, None) is not None:
                self.abort(rid)

    def abort(self, request_id: str) -> bool:
        ok = self.engine.abort_request(request_id)
        self._wake.set()
        return ok

    def finish(self, request_id: str, reason: FinishReason, stop_reason=None) -> bool:
        ok = self.engine.finish_request(request_id, reason, stop_reason)
        self._wake.set()
        return ok

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        if self.on_outputs is not None:
            self.on_outputs(outputs)
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)
                if o.finished:
                    self._queues.pop(o.request_id, None)

    def _run(self) -> None:
        """Keep up to ``engine.max_inflight`` micro-batches in flight (pipeline stages busy),
        applying each one's results as it returns, in order."""
        inflight: deque[InFlightStep] = deque()
        try:
            while not self._stop:
                while len(inflight) < self.engine.max_inflight:
                    step = self.engine.submit_step()
                    if step is None:
                        break
                    inflight.append(step)
                if inflight:
                    outputs = self.engine.complete_step(inflight.popleft())
                else:
                    outputs = self.engine.take_finished()
                    if not outputs:       # idle, or waiting requests that cannot start yet
                        self._wake.wait(0.005 if self.engine.has_work() else 0.5)
                        self._wake.clear()
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # surface to every waiting caller
            self.errored = e
            def fail(e=e):                  # bind now: `e` is unset after the except block
                for q in self._queues.values():
                    q.put_nowait(EngineError(f"engine loop died: {e!r}"))
            self._loop.call_soon_threadsafe(fail)

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)
