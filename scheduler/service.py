"""The scheduler gRPC service (``kvmesh.v1.SchedulerService``): token ids in, token ids out.

One process holds ``replicas`` engine loops (:class:`scheduler.async_engine.AsyncEngine`), each with
its own KV cache and executor (in-process model, or a Ray pipeline of stage actors). The
:class:`scheduler.router.Router` picks the replica of each new request. With ``routing=prefix``
each replica publishes its KV events (:class:`kvstore.publisher.KVEventPublisher`) to a prefix
index (:mod:`kvstore.index`: in-process, or Redis at ``redis_url``) under the name
``<scheduler_id>/<replica>``, and the router asks that index which replica holds a prompt's
prefix; a replica whose engine loop died leaves the index, and so do all of them at shutdown.
The server also speaks standard gRPC health checking (SERVING only once every replica has
loaded) and server reflection. A replica (its engine loop, load, stats, publisher, restarts)
is :mod:`scheduler.replica`; a request's trace span is :mod:`scheduler.request_span`.

A request's ``cache_salt`` goes into its block hashes (:mod:`kvstore.hashing`): the router and
its replica's block manager hash its prompt under it, so it shares cached blocks only with
requests of the same salt (per-tenant isolation; the gateway sets the salt). Request ids are
per tenant (``SubmitRequest.tenant``): an id in flight is ALREADY_EXISTS only for a request of the
same tenant (another tenant may use it at once and gets its own request), and ``Abort`` finds only
a request of the tenant it names.

Errors are gRPC statuses, by the class of the error (:mod:`kvmesh.core.status`): INVALID_ARGUMENT
(a bad request: bad sampling value, empty or too long prompt, token id outside the vocabulary,
cache_salt over 256 characters), ALREADY_EXISTS (request id of the same tenant in flight), RESOURCE_EXHAUSTED (the
chosen replica's waiting queue is full, or its KV pool can never hold the request), UNAVAILABLE
(loading, shutting down, no healthy replica, or the replica's engine failed). Cancelling a ``Submit`` call aborts its
request and frees its KV blocks.

The death window: a request whose replica dies (its engine process exits, or its engine loop
dies of a failed step, e.g. a Ray stage died) before the request has sent anything to its
caller (it was waiting, or in the failed step before its first token) is not failed: it goes
back to the router, which sends it to another live replica or waits for the restart (as a new
request does: ``restart_wait`` seconds at most, within the call's deadline). Only a stream that
has already sent tokens ends UNAVAILABLE (it cannot be resumed exactly). A request goes back at
most :data:`MAX_REDISPATCHES` times (a request that kills every engine it reaches is not retried
forever). Those UNAVAILABLE statuses, and the one of a request that found no replica up within
``restart_wait``, carry a retry hint (trailing metadata ``grpc-retry-pushback-ms``,
:data:`RETRY_AFTER`): the request may be sent again; the gateway passes the hint on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
import uuid
from urllib.parse import urlsplit

from kvmesh.core import telemetry
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import SchedulerConfig
from kvmesh.core.errors import (CapacityError, DependencyUnavailableError, DuplicateRequestError, EngineError,
                                InvalidRequestError)
from kvmesh.core.grpc_server import GrpcServer, Service, open_server
from kvmesh.core.proto import finish_reason_to_proto, sampling_params_from_proto, timings_to_proto, usage_to_proto
from kvmesh.core.status import abort, set_retry_hint
from kvmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from kvstore.index import open_index
from scheduler.engine_records import EngineOutput
from scheduler.request import FinishReason, check_length, check_prompt
from scheduler.replica import (Replica, build_engine_threads, close_engine_loop, restart_engine_process,
                               start_engine_processes, watch_steps)
from scheduler.request_span import end_request_span, start_request_span
from scheduler.router import SHARED_TIER_WEIGHT, NoHealthyReplicaError, Router, RouterStats

log = logging.getLogger("kvmesh.scheduler")

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
MAX_CACHE_SALT = 256      # characters of SubmitRequest.cache_salt
MAX_REDISPATCHES = 2      # times a request whose replica died before its first message goes back to the router
RETRY_AFTER = 1.0         # seconds: the retry hint of a request ended UNAVAILABLE by a replica's death or absence


def _response(rid: str, replica: int, o: EngineOutput) -> scheduler_pb2.SubmitResponse:
    """One stream message. The last (``finished``) carries reason, usage and timings
    (:mod:`kvmesh.core.proto`). Earlier ones carry the usage known so far where it is not zero:
    ``cached_prompt_tokens`` on the first with tokens, the speculative counts (cumulative) on each
    of a speculating request."""
    msg = scheduler_pb2.SubmitResponse(
        request_id=rid, token_ids=o.new_token_ids, replica=replica,
        logprobs=[common_pb2.TokenLogprobs(logprobs=lp) for lp in o.new_logprobs])
    if o.finished:
        msg.finished = True
        msg.finish_reason = finish_reason_to_proto(o.finish_reason)
        msg.stop_reason = "" if o.stop_reason is None else str(o.stop_reason)
        msg.usage.CopyFrom(usage_to_proto(o))
        msg.timings.CopyFrom(timings_to_proto(o))
    elif o.num_drafts or (o.num_cached_tokens and o.num_output_tokens == len(o.new_token_ids)):
        # what is known so far, for a caller that ends the request itself (the gateway on a
        # stop string): cached prompt tokens once (first tokens), speculation counts as they grow
        msg.usage.CopyFrom(usage_to_proto(o, final=False))
    return msg


def _redacted(url: str) -> str:
    """``url`` without its password (for stats and logs)."""
    u = urlsplit(url)
    if u.password is None:
        return url
    return u._replace(netloc=f"{u.username or ''}:***@{u.hostname}" + (f":{u.port}" if u.port else "")).geturl()


class SchedulerService(scheduler_pb2_grpc.SchedulerServiceServicer):
    """The servicer. ``replicas`` is empty (and ``router`` None) until they have loaded;
    ``index`` is None unless ``routing`` is ``prefix``."""

    def __init__(self, sched_cfg: SchedulerConfig, engine_cfg: EngineConfig):
        self.sched_cfg, self.engine_cfg = sched_cfg, engine_cfg
        self.scheduler_id = sched_cfg.scheduler_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        # RedisIndex connects lazily: a Redis that is down shows as routing fallbacks, not an error
        self.index = (open_index(sched_cfg.redis_url, sched_cfg.index_prefix, sched_cfg.index_timeout)
                      if sched_cfg.routing == "prefix" else None)
        self.replicas: list[Replica] = []
        self.router: Router | None = None
        # (SubmitRequest.tenant, request id) -> replica, while its stream is open: ids are per tenant
        self.requests: dict[tuple[str, str], Replica] = {}
        self.restarting: set[int] = set()           # replicas whose engine process is being restarted
        # (tenant, request id) -> set by Abort: a request between replicas ends at once
        self.aborted: dict[tuple[str, str], asyncio.Event] = {}
        self.stopping = False
        self.tracer = telemetry.setup_tracing(telemetry.SCHEDULER)    # no-op unless OTEL_TRACES_EXPORTER is set
        from kvmesh.core.metrics import SchedulerMetrics
        self.metrics = SchedulerMetrics(engine_cfg.model, self)

    def start(self, engines: list) -> None:
        """Serve with these loaded engine loops (:class:`scheduler.async_engine.AsyncEngine` or
        :class:`scheduler.engine_core.EngineCoreClient`): their replicas, publishers and the router."""
        sc = self.sched_cfg
        replicas = [Replica(i, e, f"{self.scheduler_id}/{i}") for i, e in enumerate(engines)]
        for r in replicas:
            r.aengine.on_outputs = self.metrics.observer(r.index)
        info = replicas[0].info
        self.router = Router(sc.routing, self.index, replica_ids=[r.replica_id for r in replicas],
                             hash_seed=info.hash_seed, block_size=info.block_size, prefix_weight=sc.prefix_weight,
                             load_weight=sc.load_weight, provisional_ttl=sc.provisional_ttl,
                             shared_tier_weight=SHARED_TIER_WEIGHT if self.engine_cfg.kv_offload_redis_url else 0.0)
        self.replicas = replicas
        if self.index is not None:
            for r in replicas:
                r.start_publishing(self.index)

    async def replace_engine(self, replica: Replica, aengine) -> None:
        """Give ``replica`` a new engine loop (after a restart): its metrics observer, a fresh
        publisher to the prefix index (the new engine's cache starts empty: the publisher's first
        act is a resync with its empty snapshot), nothing of the dead one in the router
        (:meth:`scheduler.router.Router.forget`), one more restart."""
        await asyncio.to_thread(replica.stop_publishing)
        if self.router is not None:
            self.router.forget(replica.index)
        aengine.on_outputs = self.metrics.observer(replica.index)
        replica.aengine, replica.info = aengine, aengine.info
        replica.restarts += 1
        if self.index is not None:
            replica.start_publishing(self.index)

    async def retire_dead(self) -> None:
        """Take replicas whose engine loop died out of the prefix index, and out of the router's
        assumptions (:meth:`scheduler.router.Router.forget`): their KV cache died with them."""
        for r in self.replicas:
            if r.publisher is not None and not r.healthy:
                self.router.forget(r.index)
                log.warning("replica %s is down (%r): removing it from the prefix index", r.replica_id,
                            r.aengine.errored or "its process exited")
                await asyncio.to_thread(r.stop_publishing)

    async def close_index(self) -> None:
        """Stop every publisher (their replicas leave the index) and close the index."""
        for r in self.replicas:
            await asyncio.to_thread(r.stop_publishing)
        close = getattr(self.index, "close", None)
        if close is not None:
            await asyncio.to_thread(close)

    async def _check_available(self, context) -> None:
        """Abort the call with UNAVAILABLE while loading or shutting down."""
        if self.stopping:
            await abort(context, DependencyUnavailableError("the scheduler is shutting down; retry on another one"))
        if not self.replicas:
            await abort(context, DependencyUnavailableError(
                f"the scheduler is still loading its {self.sched_cfg.replicas} replica(s); retry when its health "
                "check says SERVING"))

    async def Submit(self, request, context):
        """Stream the request's new token ids (an empty ``request_id`` gets a generated one).
        Status codes: see the module docstring."""
        await self._check_available(context)
        await self.retire_dead()
        rid = request.request_id or uuid.uuid4().hex
        # this service's edge: the request is validated here, once (sampling values, prompt ids,
        # max_model_len), and goes on to its replica as validated, with the router's block hashes
        try:
            params = sampling_params_from_proto(request.sampling)
        except EngineError as e:
            await abort(context, e, "sampling: ")
        if len(request.cache_salt) > MAX_CACHE_SALT:
            await abort(context, InvalidRequestError(f"cache_salt: {len(request.cache_salt)} characters exceeds "
                                                     f"{MAX_CACHE_SALT}"))
        prompt = list(request.prompt_token_ids)
        info = self.replicas[0].info
        try:
            check_prompt(prompt, info.vocab_size)
            check_length(len(prompt), params.max_tokens, info.max_model_len)
        except EngineError as e:
            await abort(context, e)
        hashes = self.router.block_hashes(prompt, request.cache_salt)
        replica = await self._pick(context, request.session_id, prompt, request.cache_salt, block_hashes=hashes)
        key = (request.tenant, rid)
        if key in self.requests:
            await abort(context, DuplicateRequestError(f"request id {rid!r} is already in flight"))
        if replica.num_waiting() >= self.sched_cfg.max_queued_requests:
            await abort(context, CapacityError(f"replica {replica.index} has {self.sched_cfg.max_queued_requests} "
                                               "requests waiting (max_queued_requests); retry later with backoff"))
        # No await between the pick above and the first __anext__ below (which adds the request
        # to the engine): concurrent Submits see each other's load.
        self.requests[key] = replica
        aborted = self.aborted[key] = asyncio.Event()
        span = start_request_span(self.tracer, context, self.engine_cfg.model, request, rid, replica, params)
        last = None
        dispatched = time.monotonic()       # when it first went to a replica
        redispatches = 0
        try:
            while True:
                aengine = replica.aengine       # this stream's engine loop (a restart gives the replica a new one)
                stream = aengine.generate(rid, prompt, params, telemetry.traceparent(span),
                                          cache_salt=request.cache_salt, tenant=request.tenant, validated=True,
                                          block_hashes=hashes)
                sent = False
                try:
                    async with contextlib.aclosing(stream):   # closing it aborts the request (cancel, disconnect)
                        async for out in stream:
                            if redispatches:         # its queue time and TTFT count the wait for a replica
                                out.arrival_time = dispatched
                            last = out
                            if out.new_token_ids or out.finished:
                                await context.write(_response(rid, replica.index, out))
                                sent = True
                    return
                except EngineError as e:    # e.g. DuplicateRequestError: an id another stream of the replica still has
                    died = aengine.errored is not None and isinstance(e, DependencyUnavailableError)
                    if not died:
                        await abort(context, e)
                    if aborted.is_set():    # an Abort that reached the replica as it died
                        break
                    if sent or redispatches >= MAX_REDISPATCHES:
                        again = "" if sent else f" (its replicas died {redispatches + 1} times under it)"
                        set_retry_hint(context, RETRY_AFTER)
                        await abort(context, DependencyUnavailableError(f"replica {replica.index} failed: {e}{again}"))
                    redispatches += 1
                    log.warning("request %s: replica %d died before the request's first token (%s): back to the "
                                "router", rid, replica.index, e)
                # the death window: nothing sent yet, so it is served elsewhere or after the restart
                picked = await self._pick(context, request.session_id, prompt, request.cache_salt, aborted,
                                          block_hashes=hashes)
                if picked is None:
                    break
                self.requests[key] = replica = picked
                if span.is_recording():
                    span.set_attributes({"kvmesh.replica": replica.index, "kvmesh.replica_id": replica.replica_id,
                                         "kvmesh.redispatches": redispatches})
            # aborted between replicas: ends as an aborted request does
            last = EngineOutput(rid, [], [], True, FinishReason.ABORT, num_prompt_tokens=len(prompt),
                                arrival_time=dispatched, finished_time=time.monotonic())
            await context.write(_response(rid, replica.index, last))
        finally:
            self.requests.pop(key, None)
            self.aborted.pop(key, None)
            if span.is_recording():
                end_request_span(self.tracer, span, last, replica.info.block_size)

    async def _pick(self, context, session_id: str, prompt: list[int], cache_salt: str = "",
                    aborted: asyncio.Event | None = None, *,
                    block_hashes: list[int] | None = None) -> "Replica | None":
        """The router's replica for a new request (or one whose replica died before its first
        message). While none is up and one is restarting or will be (``restart_replicas``: an
        engine process that has just died, before the service has noticed), waits for one
        (``restart_wait`` seconds at most, within the call's deadline); then, or when none will
        come back, aborts the call with UNAVAILABLE. Returns None once ``aborted`` is set."""
        t0 = time.monotonic()
        remaining = context.time_remaining()
        bound = self.sched_cfg.restart_wait if remaining is None else min(remaining, self.sched_cfg.restart_wait)
        while True:
            if aborted is not None and aborted.is_set():
                return None
            try:
                return self.replicas[self.router.pick([r.load() for r in self.replicas], session_id, prompt,
                                                      cache_salt, block_hashes=block_hashes)]
            except NoHealthyReplicaError as e:
                waited = time.monotonic() - t0
                comes_back = self.sched_cfg.restart_replicas and self.sched_cfg.engine_process
                if not comes_back or self.stopping or waited >= bound:
                    extra = f"; waited {waited:.1f} s for a restarting replica" if waited > 0.05 else ""
                    set_retry_hint(context, RETRY_AFTER)
                    await abort(context, DependencyUnavailableError(f"{e}{extra}"))
                await asyncio.sleep(0.05)

    async def Abort(self, request, context):
        """Abort the in-flight request ``request_id`` of ``tenant`` (``found`` False when that
        tenant has none: another tenant's request of that id is never touched); its stream ends
        with FINISH_REASON_ABORT (one between replicas, its replica dead, within 50 ms)."""
        key = (request.tenant, request.request_id)
        replica = self.requests.get(key)
        if replica is None:
            return scheduler_pb2.SchedulerAbortResponse(found=False)
        return scheduler_pb2.SchedulerAbortResponse(found=self._abort(key, replica))

    def _abort(self, key: tuple[str, str], replica: Replica) -> bool:
        """Abort open request ``key`` = (tenant, request id) on ``replica``; one between
        replicas (its replica died before its first message) ends without going to another."""
        tenant, rid = key
        aborted = self.aborted.get(key)
        if aborted is not None:
            aborted.set()
        return replica.aengine.abort(rid, tenant) or aborted is not None

    async def GetModelInfo(self, request, context):
        await self._check_available(context)
        info = self.replicas[0].info
        return scheduler_pb2.GetModelInfoResponse(
            name=self.engine_cfg.model, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            dtype=info.dtype, kv_cache_dtype=info.kv_cache_dtype, block_size=info.block_size,
            eos_token_ids=info.eos_token_ids, num_replicas=len(self.replicas),
            pipeline_parallel_size=self.sched_cfg.pp)

    async def GetStats(self, request, context):
        """Per-replica and routing stats; no replicas while they load."""
        await self.retire_dead()
        st = self.router.stats if self.router else RouterStats()
        index = "" if self.index is None else _redacted(self.sched_cfg.redis_url) or "memory"
        return scheduler_pb2.GetStatsResponse(
            replicas=[r.stats() for r in self.replicas], routing=self.sched_cfg.routing,
            scheduler_id=self.scheduler_id, index=index, routed_requests=st.routed, prefix_routed=st.prefix_hits,
            prefix_routed_blocks=st.matched_blocks, routing_fallbacks=st.fallbacks)

    def abort_all(self) -> int:
        """Abort every in-flight request (their streams end with FINISH_REASON_ABORT)."""
        return sum(self._abort(key, replica) for key, replica in list(self.requests.items()))


class SchedulerServer(Service):
    """A running scheduler service on the gRPC scaffold ``rpc``
    (:class:`kvmesh.core.grpc_server.GrpcServer`). ``port`` is the bound port, ``address`` is
    ``host:port``; ``metrics`` is its Prometheus endpoint (:class:`kvmesh.core.metrics.MetricsServer`),
    None when off; ``health_server`` the plaintext health-only port, None when off."""

    def __init__(self, rpc: GrpcServer, service: SchedulerService):
        super().__init__(rpc)
        self.service = service
        self._load_task: asyncio.Task | None = None
        self._stopped = False
        self._tasks: set[asyncio.Task] = set()      # restarts, the watchdog
        self._engine_sched_cfg = service.sched_cfg   # what engine processes get (Ray address resolved)

    async def _load(self) -> None:
        sc, ec = self.service.sched_cfg, self.service.engine_cfg
        t0 = time.monotonic()
        log.info("loading %d replica(s) of %s (executor %s, pp %d, %s)", sc.replicas, ec.model,
                 sc.resolved_executor(), sc.pp, "an engine process each" if sc.engine_process else "engine threads")
        if sc.engine_process:
            built, self._engine_sched_cfg = await start_engine_processes(sc, ec)
        else:
            built = await build_engine_threads(sc, ec)
        failed = [e for e in built if isinstance(e, BaseException)]
        if not failed and not self.service.stopping:
            try:
                self.service.start(built)
            except Exception as e:          # a publisher that cannot start
                failed = [e]
                await self.service.close_index()
                self.service.replicas = []
        if failed or self.service.stopping:
            for e in built:
                if not isinstance(e, BaseException):
                    await close_engine_loop(e)
            if failed:
                log.error("loading replicas failed: %s", failed[0])
                raise failed[0]
            return
        for r in self.service.replicas:
            r.aengine.on_death = self._replica_died
        if sc.engine_process and sc.step_timeout:
            self._tasks.add(asyncio.ensure_future(watch_steps(lambda: self.service.replicas, sc.step_timeout,
                                                              lambda: self.service.stopping)))
        await self.rpc.set_serving(True)
        log.info("scheduler serving on %s: %d replica(s) loaded in %.1f s", self.address, sc.replicas,
                 time.monotonic() - t0)

    def _replica_died(self, client) -> None:
        """A replica's engine process exited unasked (or the watchdog killed it): out of the
        index, health updated, and (``restart_replicas``) a restart with backoff begins."""
        replica = next((r for r in self.service.replicas if r.aengine is client), None)
        if replica is None or self.service.stopping:
            return
        asyncio.ensure_future(self.service.retire_dead())
        self._update_health()
        if self.service.sched_cfg.restart_replicas and replica.index not in self.service.restarting:
            self.service.restarting.add(replica.index)
            self._tasks.add(asyncio.ensure_future(self._restart(replica)))

    def _update_health(self) -> None:
        """SERVING while at least one replica is up, NOT_SERVING (with a log line) while none is."""
        up = sum(r.healthy for r in self.service.replicas)
        if bool(up) == self.rpc.serving or self.service.stopping:
            return
        self.rpc.serving = bool(up)
        if not up:
            log.error("no replica is up (0 of %d): the scheduler reports NOT_SERVING%s", len(self.service.replicas),
                      " until one is restarted" if self.service.restarting else "")
        else:
            log.warning("%d of %d replica(s) up: the scheduler reports SERVING", up, len(self.service.replicas))
        asyncio.ensure_future(self.rpc.set_serving(bool(up)))

    async def _restart(self, replica: Replica) -> None:
        """Restart a dead replica's engine process (:func:`scheduler.replica.restart_engine_process`)."""
        service = self.service

        async def install(replica: Replica, client) -> None:
            await service.replace_engine(replica, client)
            client.on_death = self._replica_died

        try:
            await restart_engine_process(replica, service.engine_cfg, self._engine_sched_cfg,
                                         stopping=lambda: service.stopping, install=install)
        finally:
            service.restarting.discard(replica.index)
            self._update_health()

    async def wait_ready(self) -> None:
        """Wait until every replica has loaded. Raises what loading raised (EngineError: bad
        model or settings)."""
        await asyncio.shield(self._load_task)

    async def stop(self, grace: float = 5.0) -> None:
        """Go NOT_SERVING, abort in-flight requests, stop the server (handlers get ``grace``
        seconds to send their final message), then shut the engines and executors down."""
        if self._stopped:
            return
        self._stopped = True
        self.service.stopping = True
        await self.rpc.enter_graceful_shutdown()
        if self._tasks:                    # restarts see `stopping` and end; the watchdog is cancelled
            done, pending = await asyncio.wait(self._tasks, timeout=30)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        with contextlib.suppress(BaseException):
            await self._load_task          # an engine thread cannot be interrupted mid-load
        n = self.service.abort_all()
        if n:
            log.info("aborted %d in-flight request(s)", n)
        await self.rpc.stop(grace)
        await self.service.close_index()
        for r in self.service.replicas:
            await r.shutdown()
        # WORKER: the spans of in-process executors
        await self.rpc.close(tracing=[telemetry.SCHEDULER, telemetry.WORKER])


async def serve_scheduler(sched_cfg: SchedulerConfig, engine_cfg: EngineConfig) -> SchedulerServer:
    """Start the scheduler service on ``sched_cfg.host:port`` (port 0 = a free port) and begin
    loading the replicas in the background; health is NOT_SERVING until they have loaded
    (``await server.wait_ready()``). Prometheus metrics on ``sched_cfg.host:metrics_port`` when it
    is not -1 (:mod:`kvmesh.core.metrics`). With ``tls_cert_file`` it listens with TLS only, with
    ``tls_client_ca_file`` also requiring client certificates of that CA (:mod:`kvmesh.core.tls`).
    Raises DependencyUnavailableError if an address cannot be bound, SettingsError if a TLS file
    cannot be read or the TLS settings do not go together."""
    from kvmesh.core import tls
    sched_cfg.check_tls()
    creds = (tls.server_credentials(sched_cfg.tls_cert_file, sched_cfg.tls_key_file, sched_cfg.tls_client_ca_file)
             if sched_cfg.tls_cert_file else None)
    service = SchedulerService(sched_cfg, engine_cfg)
    rpc = await open_server(SERVICE_NAME, sched_cfg.host, sched_cfg.port,
                            functools.partial(scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server, service),
                            credentials=creds, metrics_registry=service.metrics.registry,
                            metrics_port=sched_cfg.metrics_port, health_port=sched_cfg.health_port)
    await rpc.start()
    srv = SchedulerServer(rpc, service)
    srv._load_task = asyncio.create_task(srv._load())
    return srv
