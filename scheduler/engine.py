"""The engine loop of one replica: schedule → execute → update.

:class:`LLMEngine` is token-level and synchronous (``step()`` runs one model step);
:func:`run_engine_loop` keeps its micro-batches in flight, on a thread
(:class:`scheduler.async_engine.AsyncEngine`, which streams :class:`EngineOutput` objects to
asyncio callers) or in an engine process (:mod:`scheduler.engine_core`), in the manner of
vLLM's engine core. Text (tokenization, detokenization, stop strings) lives above, in
:mod:`kvmesh.llm` and the gateway. The values it hands out
(:class:`~scheduler.engine_records.EngineOutput`, :class:`~scheduler.engine_records.EngineInfo`,
:class:`~scheduler.engine_records.EngineStats`) are defined in :mod:`scheduler.engine_records`;
callers import them from there.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import SettingsError
from kvmesh.core.sampling import SamplingParams
from kvstore.events import HOST, POOL, KVEventSink
from kvstore.hashing import seed_hash
from scheduler.batching import make_scheduler
from scheduler.block_manager import BlockManager, BlockStats
from scheduler.engine_records import EngineInfo, EngineOutput, EngineStats
from scheduler.request import FinishReason, Request, RequestStatus, check_prompt
from scheduler.scheduler import SchedulerOutput

log = logging.getLogger("kvmesh.scheduler")

__all__ = ["InFlightStep", "LLMEngine", "eos_token_ids", "model_identity", "run_engine_loop"]


def model_identity(model_dir: Path, name: str, cfg: EngineConfig, kv_dtype: torch.dtype) -> str:
    """Stable identity of the KV contents: model (name, or directory name + config digest),
    weight dtype/format (with int4 group size and calibration, workers.quant.store.weight_identity)
    and KV dtype. Seeds the prefix-cache block hashes."""
    from workers.loader import resolve_weight_format
    from workers.quant.store import weight_identity
    digest = xxhash.xxh3_64_hexdigest((model_dir / "config.json").read_bytes())
    wf = weight_identity(resolve_weight_format(cfg.weight_format, model_dir), cfg.quant_group_size,
                         cfg.enable_calibration, cfg.calibration_data)
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
        from kvmesh.hub.pull import resolve_model  # a known name is pulled on first use
        self.cfg = cfg
        self.model_dir = resolve_model(cfg.model)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        from workers.checkpoint import load_config
        mcfg = load_config(self.model_dir)
        limit = min(mcfg.max_position_embeddings, 8192)
        if cfg.max_model_len > mcfg.max_position_embeddings:
            raise SettingsError(f"max_model_len {cfg.max_model_len} exceeds the model's "
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
        self.scheduler = make_scheduler(self.block_manager, cfg.policy, max_num_seqs=cfg.max_num_seqs,
                                        max_num_batched_tokens=max(cfg.max_num_batched_tokens, 1),
                                        max_model_len=cfg.max_model_len,
                                        enable_chunked_prefill=cfg.enable_chunked_prefill,
                                        max_prefill_tokens_with_decodes=cfg.max_prefill_tokens_with_decodes,
                                        speculative_method=cfg.speculative_method,
                                        num_speculative_tokens=cfg.num_speculative_tokens,
                                        speculative_adaptive=cfg.speculative_adaptive,
                                        speculative_max_batch_tokens=cfg.speculative_max_batch_tokens)
        self.tiers = self._make_tiers(cfg, mcfg, executor)
        self.lock = threading.RLock()
        self._emitted: dict[str, int] = {}
        self._finished_out: list[EngineOutput] = []
        self._in_flight: set[str] = set()       # ids of the requests in submitted micro-batches
        self._deferred: dict[str, tuple[FinishReason, int | str | None]] = {}
        self.num_steps = 0
        self.num_added = 0                       # add_request calls, accepted or not
        self.spec_propose_seconds = 0.0          # time spent proposing (ngram here, draft in the runner)

    def _make_tiers(self, cfg: EngineConfig, mcfg, executor):
        """The KV tiers below the pool (:mod:`kvstore.tiers`), or None when none is configured.
        Raises EngineError when the engine cannot use them."""
        if not cfg.kv_offload:
            return None
        if not cfg.enable_prefix_caching:
            raise SettingsError("KV offload (kv_offload_host_memory, kv_offload_redis_url) needs prefix caching")
        if not hasattr(executor, "save_blocks"):
            raise SettingsError(f"KV offload: executor {type(executor).__name__} cannot save or load KV blocks")
        from kvstore.tier_format import BlockLayout
        from kvstore.tiers import KVTiers
        from workers.kv_cache import is_quantized, kv_dtype
        dt = kv_dtype(cfg.kv_cache_dtype, cfg.torch_dtype)
        layout = BlockLayout(str(dt).removeprefix("torch."), dt.itemsize, cfg.block_size, mcfg.num_kv_heads,
                             mcfg.head_dim, tuple(tuple(r) for r in executor.kv_layer_ranges), is_quantized(dt),
                             getattr(executor, "tp", 1))
        tiers = KVTiers(layout, int(cfg.kv_offload_host_memory), cfg.kv_offload_redis_url, cfg.kv_offload_prefix,
                        cfg.kv_offload_redis_ttl)
        self.block_manager.offload = tiers.host is not None
        self.block_manager.write_through = tiers.redis is not None
        self.scheduler.tiers = tiers
        return tiers

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    traceparent: str | None = None, cache_salt: str | None = None, *,
                    validated: bool = False, block_hashes: Sequence[int] | None = None) -> Request:
        """Queue a request. Raises EngineError (empty prompt, token id out of range, too
        long for max_model_len or for the whole KV pool, duplicate id). ``traceparent``: W3C
        trace context handed to the workers with the request's steps (kvmesh/core/telemetry.py).
        ``cache_salt``: the request reuses (and offers) cached KV blocks only among requests
        of the same salt (:func:`kvstore.hashing.salted_seed`); None or "" = no salt.

        ``validated``: the request comes over an internal hop from an edge that has validated it
        (the scheduler service's ``Submit``: sampling values, prompt ids, max_model_len), so none
        of that is checked again; a direct caller (the LLM API) leaves it False and this is its
        edge. ``block_hashes``: the router's hashes of the prompt's full blocks, reused instead of
        hashing the prompt again (:meth:`scheduler.block_manager.BlockManager.adopt_prompt_hashes`
        checks they are this block manager's chain; on a mismatch they are computed here)."""
        self.num_added += 1
        params = params or SamplingParams()
        if not validated:
            params.validate()
            check_prompt(prompt_token_ids, self.model_config.vocab_size)
        req = Request(request_id or uuid.uuid4().hex, list(prompt_token_ids), params, self.eos_token_ids,
                      arrival_time=arrival_time or time.monotonic(), traceparent=traceparent,
                      cache_salt=cache_salt or "")
        if block_hashes and not self.block_manager.adopt_prompt_hashes(req, block_hashes) \
                and self.block_manager.enable_prefix_caching:
            log.warning("request %s: the router's block hashes are not this replica's hash chain; hashing the "
                        "prompt again", req.request_id)
        with self.lock:
            self.scheduler.add(req, validated=validated)
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

    def info(self) -> EngineInfo:
        from workers.kv_cache import KVCacheInfo
        kv = KVCacheInfo.of(self.cfg, self.model_config, self.block_manager.num_blocks)
        return EngineInfo(self.cfg.model, self.cfg.max_model_len, self.model_config.vocab_size,
                          str(self.cfg.torch_dtype).removeprefix("torch."), kv.dtype, self.cfg.block_size,
                          self.block_manager.num_blocks, self.eos_token_ids, self.block_manager.hash_seed,
                          kv.bytes_per_token, kv.max_concurrency)

    def snapshot(self) -> EngineStats:
        """The state readers see (:class:`EngineStats`), taken under the lock."""
        with self.lock:
            s, b = self.scheduler, self.block_manager.stats()
            st = EngineStats(len(s.waiting), len(s.running),
                             sum(r.num_tokens - r.num_computed_tokens for r in s.waiting),
                             sum(r.num_tokens for r in s.running), b.num_blocks, b.used, b.cached,
                             b.prefix_cache_queries, b.prefix_cache_hits, b.preempted_queries, b.preempted_hits,
                             self.num_steps, s.num_preemptions,
                             self.spec_propose_seconds, self.num_added)
            if self.tiers is not None:
                t = self.tiers.stats
                st.kv_tier_host_hits, st.kv_tier_redis_hits = t.hits["host"], t.hits["redis"]
                st.kv_tier_host_bytes_loaded, st.kv_tier_redis_bytes_loaded = t.bytes_loaded["host"], t.bytes_loaded["redis"]
                st.kv_tier_host_bytes_stored, st.kv_tier_redis_bytes_stored = t.bytes_stored["host"], t.bytes_stored["redis"]
                st.kv_tier_blocks_offloaded = t.blocks_offloaded
                st.kv_tier_load_seconds = t.lookup_seconds + t.load_seconds
                st.kv_tier_integrity_failures = t.integrity_failures + t.format_mismatches
                st.kv_tier_unavailable = t.unavailable
                st.kv_tier_host_bytes = self.tiers.host.bytes if self.tiers.host is not None else 0
            return st

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
        """Micro-batches that may be in flight at once: the executor's pipeline depth when the
        batching policy schedules around busy requests (continuous), else 1."""
        return getattr(self.executor, "max_inflight", 1) if self.scheduler.supports_micro_batches else 1

    def submit_step(self) -> "InFlightStep | None":
        """Schedule a micro-batch of the requests not already in flight and start it on the
        executor. None when there is nothing to run."""
        with self.lock, torch.profiler.record_function("schedule"):
            sched = self.scheduler.schedule(busy=self._in_flight)
            evicted, new = self.block_manager.take_evicted(), self.block_manager.take_new_cached()
            if sched.empty:
                if evicted or new:
                    self._move_blocks(evicted, new, [])
                return None
            ids = {s.req.request_id for s in sched.seqs}
            self._in_flight |= ids
        try:
            if evicted or new or sched.kv_loads:
                self._move_blocks(evicted, new, sched.kv_loads)
            handle = self.executor.submit(sched)
        except BaseException:
            self._settle(ids)
            raise
        return InFlightStep(sched, ids, handle)

    def _move_blocks(self, evicted: list[tuple[int, int]], new: list[tuple[int, int]], loads: list) -> None:
        """KV tiers, before a step: copy out of the pool the blocks evicted by its scheduling
        (to the host tier; their K/V is intact until the step runs) and the blocks that became
        cached since the last step (to Redis, write-through), then fill the blocks admitted
        from a tier. Raises EngineError when the executor fails."""
        if evicted or new:
            moved = evicted + new
            bodies = self.executor.save_blocks([b for _, b in moved])
            self.tiers.offload([h for h, _ in evicted], bodies[:len(evicted)])
            self.tiers.publish([h for h, _ in new], bodies[len(evicted):])
        if loads:
            t0 = time.perf_counter()
            ids = [b for block_ids, _ in loads for b in block_ids]
            bodies = [f.bodies for _, fetched in loads for f in fetched]
            self.executor.load_blocks(ids, bodies)
            self.tiers.stats.load_seconds += time.perf_counter() - t0

    def reset_prefix_cache(self, offload: bool = False) -> int:
        """Forget every cached block no request holds (vLLM's ``reset_prefix_cache``); blocks of
        running requests keep their hashes. Emits ``AllBlocksCleared`` to the KV-event sink.
        ``offload``: the blocks move to the KV tiers below (copied out before the next step), as
        if evicted. Returns how many cached blocks the pool forgot."""
        with self.lock:
            before = self.block_manager.stats().cached
            self.block_manager.reset_prefix_cache(offload=offload)
            return before - self.block_manager.stats().cached

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
                self._set_proposals(result)
            outputs, self._finished_out = self._finished_out, []
            outputs += [self._output(r) for r in changed]
            done = [o.request_id for o in outputs if o.finished]
            self._forward_events()
        if done:
            self.executor.free_requests(done)
        return outputs

    def _set_proposals(self, result) -> None:
        """The next step's proposals, which came back with this step's output (the runner's
        proposers: prompt lookup, the draft, or both), for the requests that still run and may
        speculate."""
        self.spec_propose_seconds += result.propose_seconds
        for rid, toks in result.proposals.items():
            r = self.scheduler.requests.get(rid)
            if r is not None and r.status == RequestStatus.RUNNING and r.can_speculate():
                r.spec_token_ids = list(toks)

    def take_finished(self) -> list[EngineOutput]:
        """Outputs of requests ended outside a step (aborts) since the last call."""
        with self.lock:
            out, self._finished_out = self._finished_out, []
            self._forward_events()
        return out

    def _forward_events(self) -> None:
        """Under the lock: the pool's KV events, then the tiers' (blocks entering or leaving the
        host tier, write-throughs that reached Redis), to the block manager's sink."""
        self.block_manager.take_events(self.tiers.take_events() if self.tiers is not None else ())

    def kv_snapshot(self) -> dict[str, list[int]]:
        """``{medium: hashes}`` of the blocks this replica can reuse from its pool and its host
        tier (a prefix-index resync, :meth:`kvstore.index_contract.PrefixIndex.resync`). Call under the
        lock, like ``take_events``, so that no event falls between a snapshot and the next batch."""
        snap = {POOL: self.block_manager.cached_block_hashes()}
        if self.tiers is not None and self.tiers.host is not None:
            snap[HOST] = self.tiers.host_block_hashes()
        return snap

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
        if self.tiers is not None:
            self.tiers.close()
        self.executor.shutdown()


@dataclass
class InFlightStep:
    """A micro-batch submitted to the executor and not yet applied."""

    sched: SchedulerOutput
    request_ids: set[str]
    handle: object          # has .result() -> ModelRunnerOutput


def run_engine_loop(engine: LLMEngine, stopped, wait, emit, before_step=None) -> None:
    """The engine loop (schedule → execute → update): keep up to ``engine.max_inflight``
    micro-batches in flight (pipeline stages busy), applying each one's results as it returns,
    in order. Shared by the engine thread (:class:`AsyncEngine`) and the engine process
    (:mod:`scheduler.engine_core`).

    Args:
        stopped: ``() -> bool``, checked before each iteration.
        wait: ``(timeout_s) -> None``, called when there is nothing to run; returns early when
            new work may have arrived.
        emit: ``(outputs) -> None`` after each iteration that ran a step or found ended requests.
        before_step: ``() -> None`` at the top of each iteration (apply queued inputs).
    """
    inflight: deque[InFlightStep] = deque()
    while not stopped():
        if before_step is not None:
            before_step()
        while len(inflight) < engine.max_inflight:
            step = engine.submit_step()
            if step is None:
                break
            inflight.append(step)
        if inflight:
            outputs = engine.complete_step(inflight.popleft())
        else:
            outputs = engine.take_finished()
            if not outputs:       # idle, or waiting requests that cannot start yet
                wait(0.005 if engine.has_work() else 0.5)
                continue
        emit(outputs)
