"""The asyncio side of an engine loop: per-request output streams (:class:`OutputStreams`) and
:class:`AsyncEngine`, which runs an :class:`scheduler.engine.LLMEngine`'s loop on a background
thread, in the manner of vLLM's AsyncLLM. The engine process's client
(:class:`scheduler.engine_core.EngineCoreClient`) is the other kind of :class:`OutputStreams`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import uuid
from collections.abc import AsyncIterator

from kvmesh.core.errors import DependencyUnavailableError, DuplicateRequestError
from kvmesh.core.sampling import SamplingParams
from scheduler.engine import LLMEngine, run_engine_loop
from scheduler.engine_records import EngineOutput, EngineStats
from scheduler.request import FinishReason


class OutputStreams:
    """The asyncio side of an engine loop that runs elsewhere (a thread, a process): a queue per
    request, delivery of each step's outputs on the event loop, and failure of every stream
    when the loop dies. Create it inside a running event loop.

    Request ids: a caller's id names one open stream (:meth:`generate`) of its ``tenant`` (the
    caller's tenant, "" = none: each tenant has an id space of its own, so two tenants may use the
    same id at once) and is free again as soon as that stream ends. The engine knows each submission by an id of its own
    (``<request id>#<n>``), so an id can be reused at once even while the engine is still
    ending its previous request (an abort waits for the step in progress) and that
    request's last output can never reach the new stream.

    Attributes:
        errored: the exception the engine loop died of (None while it runs).
        on_outputs: called on the event loop with each batch of outputs before delivery (metrics).
        stats: the last :class:`EngineStats` the loop pushed.
    """

    def __init__(self):
        self._loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue] = {}      # engine id -> its stream's queue
        self._open: dict[tuple[str, str], str] = {}     # (tenant, request id) -> engine id of its open stream
        self._submissions = itertools.count()
        self.errored: BaseException | None = None
        self.on_outputs = None
        self.stats = EngineStats()

    def add_request(self, engine_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    traceparent: str | None = None, cache_salt: str | None = None, *, validated: bool = False,
                    block_hashes: list[int] | None = None) -> asyncio.Queue:
        """Hand a request to the engine under ``engine_id``; returns the queue its outputs
        arrive on. ``validated``, ``block_hashes``: see :meth:`LLMEngine.add_request`."""
        raise NotImplementedError

    async def generate(self, request_id: str | None, prompt_token_ids: list[int],
                       params: SamplingParams | None = None, traceparent: str | None = None,
                       cache_salt: str | None = None, tenant: str = "", *, validated: bool = False,
                       block_hashes: list[int] | None = None) -> AsyncIterator[EngineOutput]:
        """Stream the request's outputs (their ``request_id`` is ``request_id``, or a generated
        one when None); aborts it if the consumer stops early. ``cache_salt``, ``validated``
        (an edge above has validated the request: the scheduler service), ``block_hashes`` (the
        router's hashes of the prompt): see :meth:`LLMEngine.add_request`; ``tenant``: whose id
        space ``request_id`` is in. Raises
        DuplicateRequestError when a stream with this id is open for this tenant, EngineError for
        a request the engine cannot serve or when the engine loop died."""
        rid = request_id or uuid.uuid4().hex
        key = (tenant, rid)
        if key in self._open:
            raise DuplicateRequestError(f"duplicate request id {rid!r}: a stream with it is in flight")
        eid = f"{rid}#{next(self._submissions)}"
        q = self.add_request(eid, prompt_token_ids, params, traceparent, cache_salt, validated=validated,
                             block_hashes=block_hashes)
        self._open[key] = eid
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                out.request_id = rid
                yield out
                if out.finished:
                    return
        finally:
            del self._open[key]
            if self._queues.pop(eid, None) is not None:
                self._abort(eid)

    def engine_id(self, request_id: str, tenant: str = "") -> str | None:
        """The engine's id of the open stream ``request_id`` of ``tenant`` (None when none is open)."""
        return self._open.get((tenant, request_id))

    def abort(self, request_id: str, tenant: str = "") -> bool:
        """Abort the open stream ``request_id`` of ``tenant`` (it ends with FINISH_REASON_ABORT);
        False when that tenant has no stream of that id open (another tenant's is never touched)."""
        eid = self._open.get((tenant, request_id))
        return eid is not None and self._abort(eid)

    def finish(self, request_id: str, reason: FinishReason, stop_reason=None, tenant: str = "") -> bool:
        """End the open stream ``request_id`` of ``tenant`` with ``reason``; False when none is open."""
        eid = self._open.get((tenant, request_id))
        return eid is not None and self._finish(eid, reason, stop_reason)

    def _abort(self, engine_id: str) -> bool:
        raise NotImplementedError

    def _finish(self, engine_id: str, reason: FinishReason, stop_reason) -> bool:
        raise NotImplementedError

    def is_up(self) -> bool:
        """Whether the engine loop runs: the router sends new requests only to one that does."""
        return self.errored is None

    def pending_load(self) -> tuple[int, int]:
        """Requests (and their prompt tokens) added but not yet reflected in ``stats``."""
        return 0, 0

    # KV events of the prefix cache (kvstore.publisher): ``kv_lock`` held while a publisher is
    # attached, so that no event falls between its snapshot and its first batch
    kv_lock: threading.RLock

    def set_kv_sink(self, sink) -> None:
        raise NotImplementedError

    def cached_block_hashes(self) -> dict[str, list[int]]:
        """``{medium: hashes}`` the replica can reuse (:meth:`LLMEngine.kv_snapshot`)."""
        raise NotImplementedError

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        if self.on_outputs is not None:
            self.on_outputs(outputs)
        for o in outputs:
            q = self._queues.get(o.request_id)
            if q is not None:
                q.put_nowait(o)
                if o.finished:
                    self._queues.pop(o.request_id, None)

    def _fail(self, request_id: str, error: BaseException) -> None:
        """End one stream with ``error`` (on the event loop)."""
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        """End every open stream with ``error`` (on the event loop); each consumer then aborts
        its request (a no-op where the engine is gone)."""
        for q in self._queues.values():
            q.put_nowait(error)


class AsyncEngine(OutputStreams):
    """Runs an :class:`LLMEngine`'s loop on a background thread; asyncio callers stream
    outputs per request. Create it inside a running event loop."""

    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self.info = engine.info()
        self.stats = engine.snapshot()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    def add_request(self, engine_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    traceparent: str | None = None, cache_salt: str | None = None, *, validated: bool = False,
                    block_hashes: list[int] | None = None) -> asyncio.Queue:
        """Queue a request; returns the queue its :class:`EngineOutput`s arrive on. Raises
        EngineError at once for a request that cannot be served."""
        if self.errored is not None:
            raise DependencyUnavailableError(f"engine loop died: {self.errored!r}")
        q: asyncio.Queue = asyncio.Queue()
        try:
            self.engine.add_request(engine_id, prompt_token_ids, params, traceparent=traceparent,
                                    cache_salt=cache_salt, validated=validated, block_hashes=block_hashes)
        finally:
            self.stats = self.engine.snapshot()
        self._queues[engine_id] = q
        self._wake.set()
        return q

    def _abort(self, engine_id: str) -> bool:
        ok = self.engine.abort_request(engine_id)
        self._wake.set()
        return ok

    def _finish(self, engine_id: str, reason: FinishReason, stop_reason) -> bool:
        ok = self.engine.finish_request(engine_id, reason, stop_reason)
        self._wake.set()
        return ok

    @property
    def kv_lock(self) -> threading.RLock:
        return self.engine.lock

    def set_kv_sink(self, sink) -> None:
        with self.engine.lock:
            self.engine.block_manager.sink = sink

    def cached_block_hashes(self) -> dict[str, list[int]]:
        with self.engine.lock:
            return self.engine.kv_snapshot()

    def _wait(self, timeout: float) -> None:
        self._wake.wait(timeout)
        self._wake.clear()

    def _emit(self, outputs: list[EngineOutput]) -> None:
        self.stats = self.engine.snapshot()
        self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _run(self) -> None:
        try:
            run_engine_loop(self.engine, lambda: self._stop, self._wait, self._emit)
        except BaseException as e:  # surface to every waiting caller
            self.errored = e
            self._loop.call_soon_threadsafe(self._fail_all, DependencyUnavailableError(f"engine loop died: {e!r}"))

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)
