"""The public gateway: ``kvmesh.v1.LLMService`` over gRPC, in front of the scheduler service.

One request: validate → tokenize (the model's tokenizer and chat template) → ``Submit`` the token
ids to the scheduler → turn the streamed token ids into UTF-8-safe text deltas with
:class:`gateway.output_processor.OutputProcessor` (stop strings are matched here) → stream
``GenerateResponse`` messages to the client, the last one with ``finished`` set. That path is
:class:`gateway.stream.RequestPath`, which the OpenAI-compatible HTTP API
(:mod:`gateway.http_api`, ``--http-port``) shares: the same validation, limits, deadlines,
stop strings and usage behind both.

Rules a client sees:

* Every bad request ends with INVALID_ARGUMENT and a message naming the field (``prompt``,
  ``prompt_token_ids``, ``messages[1].role``, ``model``, ``sampling: temperature ...``,
  ``max_tokens``, ``timeout``, ``request_id``); a request whose bytes do not parse (e.g. a
  string field holding invalid UTF-8) too, naming the field where it can be found.
* Limits (:class:`kvmesh.core.service_config.GatewayConfig`, checked before any tokenizing): stop strings
  (``max_stop_strings``, ``max_stop_chars`` in all), ``max_stop_token_ids``, ``max_id_length``
  (request and session ids), ``max_prompt_tokens`` and ``max_message_bytes``; over one →
  INVALID_ARGUMENT naming the field and the limit.
* Request ids: an id in flight on this gateway is ALREADY_EXISTS (the scheduler answers the
  same across gateways); an id is free again once its final message is sent. With API keys the
  id space is the tenant's: only a request of the same tenant makes an id ALREADY_EXISTS,
  another tenant's live request of that id is unseen (the caller gets its own request). Ids
  (request, session, ``cache_salt``) must not hold control characters (U+0000-U+001F, U+007F-U+009F).
* ``max_tokens`` (tokens): unset → ``min(default_max_tokens, max_tokens_cap, room)`` where room =
  ``max_model_len - prompt tokens``; set above ``max_tokens_cap`` → clamped to the cap. A set
  value (after clamping) with ``prompt + max_tokens > max_model_len`` is INVALID_ARGUMENT, as
  is a prompt with no room for one output token. The value used is sent back in the trailing
  metadata ``kvmesh-max-tokens``; the final message's ``usage.completion_tokens`` shows what
  was generated.
* Streaming: one message per scheduler message, carrying its token ids (and logprobs when
  asked) and the text that became safe to emit (possibly ""). The final message carries the
  last delta (flushed text included), ``finish_reason``, ``stop_reason``, ``usage`` and
  ``timings`` (the scheduler's; for a stop-string finish the gateway's own clock, Submit sent
  → now, since the scheduler never finished the request).
* A stop string ends the upstream call at once (the scheduler aborts the request and frees its
  KV blocks) before the final message is sent; that message has FINISH_REASON_STOP,
  ``stop_reason`` = the string, and usage with the cached prompt tokens and speculative counts
  the scheduler reported on earlier messages. Matching costs O(new text) per message
  (:mod:`gateway.stop_matcher`); its automaton is built off the event loop.
* Deadline (seconds): the request's ``timeout`` (default ``default_timeout``, at most
  ``max_timeout``), also bounded by the client's own gRPC deadline. It is the deadline of the
  upstream ``Submit`` call; when it passes the call is cancelled (the scheduler aborts) and the
  RPC ends with DEADLINE_EXCEEDED, its trailing metadata ``kvmesh-usage-bin`` holding the usage
  so far (a serialized ``kvmesh.v1.Usage``).
* Client cancel/disconnect: grpc cancels the handler; the upstream call is cancelled in a
  ``finally``, so the scheduler aborts the request at its next step.
* ``Abort(request_id)``: a request of this gateway has its upstream call cancelled and its
  stream ends with FINISH_REASON_ABORT; an id this gateway does not know is forwarded to the
  scheduler's Abort. Only the request's own tenant can abort it (another's: ``found`` False,
  as for an id that is not in flight).
* Errors of the scheduler pass through with their code, message and retry hint (INVALID_ARGUMENT,
  ALREADY_EXISTS, RESOURCE_EXHAUSTED, UNAVAILABLE ...; a stream its replica's death cut, or a
  request that found no replica up, is UNAVAILABLE with ``grpc-retry-pushback-ms``: 1000); a scheduler that cannot be reached is
  UNAVAILABLE ``scheduler at ADDR unreachable: ...`` (a call the scheduler cancelled is
  UNAVAILABLE too); an error the gateway raises itself answers the status of its class
  (:mod:`kvmesh.core.status`: a bad request INVALID_ARGUMENT, a dependency down UNAVAILABLE); a
  bug in the gateway is INTERNAL. The server keeps serving after any of them. At start, a
  scheduler that cannot be reached, a port in use or a model download that fails is a
  :class:`~kvmesh.core.errors.DependencyUnavailableError`; an unknown model or a bad keys or TLS
  file a :class:`~kvmesh.core.errors.SettingsError`.

Shutdown (:meth:`GatewayServer.stop`, on SIGTERM/SIGINT through ``kvmesh serve`` or ``kvmesh
gateway``; ``--grace``): health goes NOT_SERVING first, for every name, so probes and load
balancers stop sending; the ports stay open and every new RPC but Abort (and every new HTTP
request) ends at once with UNAVAILABLE ``the gateway is shutting down ...: retry it, on another
gateway`` and a retry hint (trailing metadata ``grpc-retry-pushback-ms``: 1000; HTTP 503 with
``Retry-After: 1``); requests in flight (streaming, tokenizing) get ``grace`` seconds to finish
as usual. Any still running then end with a status, never cut: UNAVAILABLE ``request R: the
gateway shut down before the request finished ... after N tokens; retry it``, with the retry
hint and the usage so far (``kvmesh-usage-bin``; over HTTP an error event then ``data:
[DONE]``), their upstream calls cancelled (the scheduler aborts them). Then the ports close.

Security (:mod:`gateway.auth`, :mod:`kvmesh.core.tls`): with API keys (``api_keys_file`` or
``KVMESH_API_KEYS``) an RPC without ``authorization: Bearer <key>`` of a current key ends
UNAUTHENTICATED before its request is read (health and reflection stay open), an HTTP request
401; the key's tenant labels the request's metrics and spans and partitions the prefix cache
(the scheduler gets ``cache_salt`` = :func:`gateway.auth.cache_salt` of the tenant and the
request's ``cache_salt``, so two tenants never share cached blocks). With
``tls_cert_file``/``tls_key_file`` the gateway (gRPC and HTTP) listens with TLS only;
``scheduler_tls_*`` make it dial the scheduler with TLS (mutual TLS with a client certificate);
``health_port`` serves plaintext health checks for probes that cannot speak TLS.

Health (``grpc.health.v1``; the HTTP API's ``/health`` says the same): "" and
``kvmesh.v1.LLMService`` (readiness) follow the scheduler's own health: the gateway keeps a
``Health.Watch`` of ``kvmesh.v1.SchedulerService`` open on its channel to the scheduler and is
SERVING while the scheduler reports SERVING (it has a replica up), NOT_SERVING while it reports
anything else (no replica up: a restart under way; loading; shutting down) and while the Watch
fails (the scheduler unreachable); also before the tokenizer is loaded and from
:meth:`GatewayServer.stop` on. Requests are still passed on while NOT_SERVING (the scheduler
decides: it waits for a restarting replica within ``restart_wait``). The health name
``liveness`` (:data:`kvmesh.core.grpc_server.LIVENESS`) is SERVING from the bind until the stop,
whatever the scheduler's state: the probe that restarts a stuck gateway asks it, so that a
replica restart behind the scheduler never restarts the gateway. One gateway follows one
scheduler (``scheduler_address``). Server reflection lists the LLMService, health and reflection
services.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.auth import CURRENT_TENANT, ApiKeyInterceptor, ApiKeys
from gateway.stream import RequestPath, Status, invalid
from kvmesh.core import telemetry
from kvmesh.core.errors import DependencyUnavailableError, EngineError
from kvmesh.core.grpc_server import SCAFFOLD_SERVICES, SERVING, GrpcServer, Service, open_server
from kvmesh.core.service_config import GatewayConfig
from kvmesh.core.status import grpc_code
from kvmesh.v1 import llm_pb2, scheduler_pb2

log = logging.getLogger("kvmesh.gateway")

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
SCHEDULER_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name
WATCH_RETRY = 0.25      # seconds between two Health.Watch calls when one ended or failed
STOP_GRACE = 1.0        # seconds the ports stay open after the drain, for RPCs being refused
_Code = grpc.StatusCode
# Reconnect quickly to a restarted scheduler (grpc's default backoff grows to 120 s).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 5000)]

# ---- request bytes that do not parse -----------------------------------------------------------

@dataclass
class _Undecodable:
    """What the lenient deserializer hands the servicer instead of a message it cannot parse."""

    message: str


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def _bad_utf8_field(data: bytes, desc, prefix: str = "") -> str | None:
    """Path (``sampling.stop[0]``) of the first string field of ``data`` that is not valid UTF-8,
    walking the protobuf wire format along ``desc``; None if there is none (or the bytes are not
    well-formed wire format)."""
    counts: dict[int, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _varint(data, i)
            elif wire in (1, 5):
                i += 8 if wire == 1 else 4
            elif wire == 2:
                n, i = _varint(data, i)
                chunk, i = data[i:i + n], i + n
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                name = prefix + field.name
                if field.is_repeated:
                    counts[number] = counts.get(number, 0) + 1
                    name += f"[{counts[number] - 1}]"
                if field.type == field.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == field.TYPE_MESSAGE:
                    found = _bad_utf8_field(chunk, field.message_type, name + ".")
                    if found:
                        return found
            else:
                return None
    except IndexError:
        return None
    return None


def _lenient(cls, max_bytes: int):
    """A request deserializer that returns :class:`_Undecodable` instead of raising, so that a
    request grpc cannot parse ends as INVALID_ARGUMENT (grpc's own answer would be UNKNOWN), as
    does one over ``max_bytes`` bytes (GatewayConfig.max_message_bytes), unparsed."""

    def deserialize(data: bytes):
        if len(data) > max_bytes:
            return _Undecodable(f"request: {len(data)} bytes exceeds max_message_bytes ({max_bytes})")
        try:
            return cls.FromString(data)
        except DecodeError as e:
            field = _bad_utf8_field(data, cls.DESCRIPTOR)
            if field:
                return _Undecodable(f"{field}: not valid UTF-8 (string fields must be UTF-8)")
            return _Undecodable(f"request is not a valid {cls.DESCRIPTOR.full_name}: {e}")

    return deserialize



# ---- the servicer -------------------------------------------------------------------------------

MAX_DETAILS_BYTES = 1024    # UTF-8 bytes of a status message: grpc sends it percent-encoded in a header


def _details(message: str) -> str:
    """A status message cut to MAX_DETAILS_BYTES bytes of UTF-8 (on a character boundary, with
    a mark): grpc sends it in the ``grpc-message`` header, percent-encoded (up to 3 characters a
    byte), and a client refuses headers over 8 KiB: an error whose text echoed a huge value
    would reach it as RESOURCE_EXHAUSTED instead of its own status."""
    data = message.encode("utf-8", "backslashreplace")
    if len(data) <= MAX_DETAILS_BYTES:
        return message
    return data[:MAX_DETAILS_BYTES].decode("utf-8", "ignore") + "... (message truncated)"


def _rpc(method):
    """Map what an RPC method raises to a status: Status as is (its usage, if any, in the trailing
    metadata ``kvmesh-usage-bin``, its retry hint in ``grpc-retry-pushback-ms``), EngineError → its class's status
    (:func:`kvmesh.core.status.grpc_code`: InvalidRequestError INVALID_ARGUMENT ...), any
    other exception → INTERNAL (logged); every message at most MAX_DETAILS_BYTES (:func:`_details`).
    Also rejects unparsable requests, RPCs that arrive before the gateway is ready and, while it
    drains (:meth:`GatewayServer.stop`), every RPC but Abort (:meth:`gateway.stream.RequestPath.admitted`)."""

    @functools.wraps(method)
    async def wrapper(self: "LLMServicer", request, context: grpc.aio.ServicerContext):
        code = "OK"                 # the final status, for kvmesh:gateway_requests_total
        try:
            if isinstance(request, _Undecodable):
                raise invalid(request.message)
            self.path.check_ready()
            if method.__name__ == "Abort":      # served while draining: it ends a request in flight
                return await method(self, request, context)
            with self.path.admitted():
                return await method(self, request, context)
        except Status as e:
            code = e.code.name
            extra = ()
            if e.usage is not None:
                extra += (("kvmesh-usage-bin", e.usage.SerializeToString()),)
            if e.retry_after is not None:
                extra += (("grpc-retry-pushback-ms", str(round(e.retry_after * 1000))),)
            if extra:
                context.set_trailing_metadata(tuple(context.trailing_metadata() or ()) + extra)
            await context.abort(e.code, _details(e.message))
        except EngineError as e:           # its class says whose fault: kvmesh.core.status
            code = grpc_code(e).name
            await context.abort(grpc_code(e), _details(str(e)))
        except grpc.aio.AbortError:
            code = getattr(context.code(), "name", "UNKNOWN")
            raise
        except asyncio.CancelledError:      # the client cancelled or went away
            code = "CANCELLED"
            raise
        except Exception as e:
            code = "INTERNAL"
            log.exception("%s failed", method.__name__)
            await context.abort(_Code.INTERNAL, _details(f"internal error in the gateway: {type(e).__name__}: {e}"))
        finally:
            if method.__name__ in ("Generate", "Chat"):
                self.path.metrics.request_done(method.__name__, code, CURRENT_TENANT.get())

    return wrapper


class LLMServicer:
    """``kvmesh.v1.LLMService`` over :class:`gateway.stream.RequestPath` (``path``), which the
    HTTP API shares."""

    def __init__(self, path: RequestPath):
        self.path = path

    # ---- RPCs ------------------------------------------------------------------------------
    @_rpc
    async def Generate(self, request: llm_pb2.GenerateRequest, context) -> None:
        await self._stream("generate", "text_completion", request, context)

    @_rpc
    async def Chat(self, request: llm_pb2.ChatRequest, context) -> None:
        await self._stream("chat", "chat", request, context)

    async def _stream(self, name: str, operation: str, request, context: grpc.aio.ServicerContext) -> None:
        """Validate, tokenize, submit ``request`` and stream its messages to ``context``; the
        ``max_tokens`` used goes in the trailing metadata ``kvmesh-max-tokens``."""
        path = self.path
        with path.span(name, operation, request, context.invocation_metadata()):
            path.check_model(request.model)
            path.check_limits(request)
            prompt_ids = await path.prompt_ids(request)
            prepared = await path.prepare(request, prompt_ids, context.time_remaining())
            context.set_trailing_metadata((("kvmesh-max-tokens", str(prepared.forward.max_tokens)),))
            async with contextlib.aclosing(path.stream(prepared)) as messages:
                async for out in messages:
                    await context.write(out)

    @_rpc
    async def Abort(self, request: llm_pb2.AbortRequest, context) -> llm_pb2.AbortResponse:
        if not request.request_id:
            raise invalid("request_id: required")
        return llm_pb2.AbortResponse(found=await self.path.abort(request.request_id))

    @_rpc
    async def ListModels(self, request, context) -> llm_pb2.ListModelsResponse:
        i = self.path.info
        return llm_pb2.ListModelsResponse(models=[llm_pb2.ModelInfo(
            name=i.name, max_model_len=i.max_model_len, vocab_size=i.vocab_size, dtype=i.dtype)])

    @_rpc
    async def Tokenize(self, request: llm_pb2.TokenizeRequest, context) -> llm_pb2.TokenizeResponse:
        path = self.path
        path.check_model(request.model)
        kind = request.WhichOneof("input")
        if kind == "prompt":
            _, ids = await asyncio.to_thread(path.text.encode_prompt, request.prompt)
        elif kind == "chat":
            ids = await path.prompt_ids(request.chat)
        else:
            raise invalid("prompt: a prompt or chat is required")
        return llm_pb2.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=path.info.max_model_len)


# ---- server ---------------------------------------------------------------------------------------

def _add_servicer(servicer: LLMServicer, server: grpc.aio.Server) -> None:
    """Register like the generated ``add_LLMServiceServicer_to_server``, with lenient deserializers."""
    methods = {"Generate": (grpc.unary_stream_rpc_method_handler, llm_pb2.GenerateRequest, llm_pb2.GenerateResponse),
               "Chat": (grpc.unary_stream_rpc_method_handler, llm_pb2.ChatRequest, llm_pb2.GenerateResponse),
               "Abort": (grpc.unary_unary_rpc_method_handler, llm_pb2.AbortRequest, llm_pb2.AbortResponse),
               "ListModels": (grpc.unary_unary_rpc_method_handler, llm_pb2.ListModelsRequest,
                              llm_pb2.ListModelsResponse),
               "Tokenize": (grpc.unary_unary_rpc_method_handler, llm_pb2.TokenizeRequest, llm_pb2.TokenizeResponse)}
    limit = servicer.path.cfg.max_message_bytes
    handlers = {name: make(getattr(servicer, name), request_deserializer=_lenient(req, limit),
                           response_serializer=resp.SerializeToString)
                for name, (make, req, resp) in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class GatewayServer(Service):
    """A running gateway on the gRPC scaffold ``rpc`` (:class:`kvmesh.core.grpc_server.GrpcServer`).
    ``port`` is the bound port, ``address`` is ``host:port``; ``metrics`` is its Prometheus endpoint
    (:class:`kvmesh.core.metrics.MetricsServer`), None when off; ``http`` its OpenAI-compatible HTTP
    server (:class:`gateway.http_api.HttpServer`), None when off; ``api_keys`` its
    :class:`gateway.auth.ApiKeys` (None: no keys needed); ``health_server`` the plaintext
    health-only port, None when off."""

    def __init__(self, rpc: GrpcServer, servicer: LLMServicer, api_keys: ApiKeys | None = None):
        super().__init__(rpc)
        self.servicer, self.path = servicer, servicer.path
        self.api_keys = api_keys
        self.http = None
        self._watch_task: asyncio.Task | None = None
        self._watched = asyncio.Event()     # set once the scheduler's health is known (or its Watch failed)
        self._stopped = False

    async def _set_serving(self, serving: bool) -> None:
        if self._stopped:
            return
        if serving != self.path.serving:
            log.log(logging.INFO if serving else logging.WARNING, "the scheduler at %s %s: the gateway reports %s",
                    self.path.cfg.scheduler_address, "can serve" if serving else "cannot serve (no replica up, "
                    "unreachable or stopping)", "SERVING" if serving else "NOT_SERVING")
        self.path.serving = serving
        await self.rpc.set_serving(serving)

    async def _watch_scheduler(self) -> None:
        """Follow the scheduler's health (module docstring): a ``Health.Watch`` of
        ``kvmesh.v1.SchedulerService`` over the channel, waiting for the channel to be ready (so
        it also keeps a connection to the scheduler); SERVING while it streams SERVING,
        NOT_SERVING on any other status, when the stream fails (the scheduler unreachable or
        gone) and when it ends (the scheduler is stopping); then a new Watch after
        :data:`WATCH_RETRY` seconds. Runs until cancelled."""
        stub = health_pb2_grpc.HealthStub(self.path.channel)
        request = health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE)
        unimplemented = False
        while True:
            try:
                async for r in stub.Watch(request, wait_for_ready=True):
                    await self._set_serving(r.status == SERVING)
                    self._watched.set()
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED and not unimplemented:
                    log.error("the scheduler at %s does not serve grpc.health.v1 Watch (%s): the gateway reports "
                              "NOT_SERVING", self.path.cfg.scheduler_address, e.details())
                unimplemented = e.code() == grpc.StatusCode.UNIMPLEMENTED
            await self._set_serving(False)
            self._watched.set()
            await asyncio.sleep(WATCH_RETRY)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Drain, then stop (module docstring, "Shutdown"): health NOT_SERVING at once (every name,
        ``liveness`` too); new requests (gRPC and HTTP; all RPCs but Abort) answered UNAVAILABLE
        with a retry hint while the ports stay open; requests in flight given ``grace`` seconds
        (None = however long they take) to finish; those still running then end UNAVAILABLE
        (their upstream calls cancelled: the scheduler aborts them) with a retry hint and their
        usage so far; then the ports close and the channel to the scheduler. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.path.serving = False
        await self.rpc.enter_graceful_shutdown()
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        t0, busy = time.monotonic(), self.path.active
        if busy:
            log.info("gateway draining: %d request(s) in flight, %s", busy,
                     "no time limit" if grace is None else f"{grace:g} s to finish")
        left = await self.path.drain(grace)
        if left:
            log.warning("gateway: %d request(s) still running after the %g s grace: ending them UNAVAILABLE", left,
                        grace)
            await self.path.end_all(f"the gateway shut down before the request finished (its {grace:g} s grace "
                                    "for requests in flight ran out)")
        elif busy:
            log.info("gateway drained in %.1f s", time.monotonic() - t0)
        # nothing left in flight but requests being refused this instant: a short grace for those
        await self.rpc.stop(STOP_GRACE, alongside=[self.http.stop(STOP_GRACE)] if self.http is not None else [])
        self.path.cancel_all()
        await self.path.channel.close()
        await self.rpc.close(tracing=[telemetry.GATEWAY])      # exports the last spans


async def _wait_for_scheduler(stub, cfg: GatewayConfig) -> scheduler_pb2.GetModelInfoResponse:
    """GetModelInfo, retried until it succeeds or ``cfg.connect_timeout`` seconds pass.
    Raises EngineError naming the address and the last error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.connect_timeout
    last = "no answer"
    while (left := deadline - loop.time()) > 0:
        try:
            return await stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest(), timeout=min(left, 10.0))
        except grpc.aio.AioRpcError as e:
            last = f"{e.code().name}: {e.details()}"
            if e.code() not in (_Code.UNAVAILABLE, _Code.DEADLINE_EXCEEDED):
                raise DependencyUnavailableError(f"scheduler at {cfg.scheduler_address} answered GetModelInfo "
                                                 f"with {last}") from None
        await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))
    raise DependencyUnavailableError(f"scheduler at {cfg.scheduler_address} unreachable after "
                                     f"{cfg.connect_timeout:g} s: {last}")


async def serve_gateway(cfg: GatewayConfig) -> GatewayServer:
    """Start the gateway on ``cfg.host:cfg.port`` (port 0 = a free port) and return once it serves.

    The port is bound first (health NOT_SERVING, RPCs UNAVAILABLE meanwhile); then the scheduler
    at ``cfg.scheduler_address`` is awaited (GetModelInfo, up to ``cfg.connect_timeout`` seconds),
    the served model's tokenizer is loaded (``kvmesh.hub.pull.resolve_model`` of the scheduler's
    model name: a known name, pulled if missing, or a directory that must exist here too), and
    health follows the scheduler's (module docstring) from its first answer on, which this
    waits for (within ``connect_timeout``). Prometheus metrics on ``cfg.host:metrics_port`` when it is not -1
    (:mod:`kvmesh.core.metrics`); the OpenAI-compatible HTTP API on ``cfg.host:http_port`` when it is
    not -1 (:mod:`gateway.http_api`, bound with the gRPC port, answering 503 until SERVING). API
    keys and TLS (both ports), the health-only port: module docstring.

    Raises:
        DependencyUnavailableError: an address cannot be bound; the scheduler is unreachable
            within ``connect_timeout``; the model's files cannot be downloaded.
        SettingsError: the scheduler's model is not a known name nor a directory here; a keys
            file or a TLS file cannot be read or parsed, or the TLS settings do not go together.
        The server is stopped in every case.
    """
    from gateway.text import load_tokenizer
    from kvmesh.core import tls
    from kvmesh.hub.pull import resolve_model

    cfg.check_tls()
    keys = ApiKeys.load(cfg.api_keys_file)
    server_creds = tls.server_credentials(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file else None
    if cfg.scheduler_tls_ca_file:
        channel = grpc.aio.secure_channel(cfg.scheduler_address, tls.channel_credentials(
            cfg.scheduler_tls_ca_file, cfg.scheduler_tls_client_cert_file, cfg.scheduler_tls_client_key_file,
            prefix="scheduler_"), options=_CHANNEL_OPTIONS + tls.server_name_option(cfg.scheduler_tls_server_name))
    else:
        channel = grpc.aio.insecure_channel(cfg.scheduler_address, options=_CHANNEL_OPTIONS)
    servicer = LLMServicer(RequestPath(cfg, channel))
    interceptors = []
    if keys is not None:
        interceptors.append(ApiKeyInterceptor(keys, SCAFFOLD_SERVICES,
                                              on_denied=servicer.path.metrics.denied))
    try:
        # requests up to twice max_message_bytes reach the deserializer, which names the limit
        # (INVALID_ARGUMENT)
        rpc = await open_server(SERVICE_NAME, cfg.host, cfg.port, functools.partial(_add_servicer, servicer),
                                credentials=server_creds, interceptors=interceptors,
                                options=[("grpc.max_receive_message_length", 2 * cfg.max_message_bytes)],
                                metrics_registry=servicer.path.metrics.registry, metrics_port=cfg.metrics_port,
                                health_port=cfg.health_port)
    except BaseException:
        await channel.close()
        raise
    gw = GatewayServer(rpc, servicer, keys)
    if cfg.http_port != -1:
        from gateway.http_api import start_http
        try:
            gw.http = await start_http(gw.path, cfg.host, cfg.http_port, api_keys=keys,
                                       tls_cert_file=cfg.tls_cert_file, tls_key_file=cfg.tls_key_file,
                                       max_header_bytes=cfg.max_header_bytes)
        except BaseException:
            await channel.close()
            await rpc.abandon()
            raise
    await rpc.start()
    try:
        info = await _wait_for_scheduler(servicer.path.stub, cfg)
        tokenizer = await asyncio.to_thread(lambda: load_tokenizer(resolve_model(info.name)))
    except BaseException:
        await gw.stop(0)
        raise
    servicer.path.set_model(info, tokenizer)
    gw._watch_task = asyncio.create_task(gw._watch_scheduler())
    # the scheduler answered GetModelInfo: its health is one Watch message away
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(gw._watched.wait(), max(1.0, cfg.connect_timeout))
    log.info("gateway serving %s on %s (scheduler %s)%s%s", info.name, gw.address, cfg.scheduler_address,
             ", TLS" if server_creds else "", f", API keys of {len(keys.tenants)} tenant(s)" if keys else "")
    return gw
