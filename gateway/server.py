"""The public gateway: ``kvmesh.v1.LLMService`` over gRPC, in front of the scheduler service.

One request: validate → tokenize (the model's tokenizer and chat template) → ``Submit`` the token
ids to the scheduler → turn the streamed token ids into UTF-8-safe text deltas with
:class:`gateway.detokenizer.IncrementalDetokenizer` (stop strings are matched here) → stream
``GenerateResponse`` messages to the client, the last one with ``finished`` set.

Rules a client sees:

* Every bad request ends with INVALID_ARGUMENT and a message naming the field (``prompt``,
  ``prompt_token_ids``, ``messages[1].role``, ``model``, ``sampling: temperature ...``,
  ``max_tokens``, ``timeout``, ``request_id``); a request whose bytes do not parse (e.g. a
  string field holding invalid UTF-8) too, naming the field where it can be found.
* Limits (:class:`kvmesh.config.GatewayConfig`, checked before any tokenizing): stop strings
  (``max_stop_strings``, ``max_stop_chars`` in all), ``max_stop_token_ids``, ``max_id_length``
  (request and session ids), ``max_prompt_tokens`` and ``max_message_bytes``; over one →
  INVALID_ARGUMENT naming the field and the limit.
* Request ids: an id in flight on this gateway is ALREADY_EXISTS (the scheduler answers the
  same across gateways); an id is free again once its final message is sent.
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
  scheduler's Abort. Only the request's own tenant can abort it (another's: ``found`` False).
* Errors of the scheduler pass through with their code and message (INVALID_ARGUMENT,
  ALREADY_EXISTS, RESOURCE_EXHAUSTED, UNAVAILABLE ...); a scheduler that cannot be reached is
  UNAVAILABLE ``scheduler at ADDR unreachable: ...`` (a call the scheduler cancelled is
  UNAVAILABLE too); a bug in the gateway is INTERNAL. The server keeps serving after any of them.

Security (:mod:`gateway.auth`, :mod:`kvmesh.tls`): with API keys (``api_keys_file`` or
``KVMESH_API_KEYS``) an RPC without ``authorization: Bearer <key>`` of a current key ends
UNAUTHENTICATED before its request is read (health and reflection stay open); the key's tenant
labels the request's metrics and spans and partitions the prefix cache (the scheduler gets
``cache_salt`` = :func:`gateway.auth.cache_salt` of the tenant and the request's ``cache_salt``,
so two tenants never share cached blocks). With ``tls_cert_file``/``tls_key_file`` the gateway
listens with TLS only; ``scheduler_tls_*`` make it dial the scheduler with TLS (mutual TLS with
a client certificate).

Health (``grpc.health.v1``): "" and ``kvmesh.v1.LLMService`` are SERVING once the scheduler
answered and the tokenizer is loaded, NOT_SERVING while the connection to the scheduler is
failing and after :meth:`GatewayServer.stop`. Server reflection lists the LLMService, health
and reflection services.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from opentelemetry import trace
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.auth import CURRENT_TENANT, ApiKeyInterceptor, ApiKeys, cache_salt
from gateway.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from kvmesh import telemetry
from kvmesh.config import GatewayConfig
from kvmesh.v1 import common_pb2, llm_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler.request import EngineError, SamplingParams

log = logging.getLogger("kvmesh.gateway")

SERVICE_NAME = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
ROLES = ("system", "user", "assistant")
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
_Code = grpc.StatusCode
# Failures grpc-core reports for a connection (not statuses a scheduler sends itself).
_CONNECTION_ERRORS = ("failed to connect", "connections to all backends failing", "socket closed",
                      "connection reset", "connection refused", "broken pipe", "goaway", "endpoint closing")
# Reconnect quickly to a restarted scheduler (grpc's default backoff grows to 120 s).
_ABORT_TIMEOUT = 10.0      # seconds for a forwarded Abort
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 5000)]


class _Status(Exception):
    """End the RPC with this gRPC status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _invalid(message: str) -> _Status:
    return _Status(_Code.INVALID_ARGUMENT, message)


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

def _rpc(method):
    """Map what an RPC method raises to a status: _Status as is, EngineError → INVALID_ARGUMENT,
    any other exception → INTERNAL (logged). Also rejects unparsable requests and RPCs that arrive
    before the gateway is ready."""

    @functools.wraps(method)
    async def wrapper(self: "LLMServicer", request, context: grpc.aio.ServicerContext):
        code = "OK"                 # the final status, for kvmesh:gateway_requests_total
        try:
            if isinstance(request, _Undecodable):
                raise _invalid(request.message)
            if self.info is None:
                raise _Status(_Code.UNAVAILABLE, f"the gateway is starting: waiting for the scheduler at "
                                                 f"{self.cfg.scheduler_address}")
            return await method(self, request, context)
        except _Status as e:
            code = e.code.name
            await context.abort(e.code, e.message)
        except EngineError as e:
            code = "INVALID_ARGUMENT"
            await context.abort(_Code.INVALID_ARGUMENT, str(e))
        except grpc.aio.AbortError:
            code = getattr(context.code(), "name", "UNKNOWN")
            raise
        except asyncio.CancelledError:      # the client cancelled or went away
            code = "CANCELLED"
            raise
        except Exception as e:
            code = "INTERNAL"
            log.exception("%s failed", method.__name__)
            await context.abort(_Code.INTERNAL, f"internal error in the gateway: {type(e).__name__}: {e}")
        finally:
            if method.__name__ in ("Generate", "Chat"):
                self.metrics.request_done(method.__name__, code, CURRENT_TENANT.get())

    return wrapper


@dataclass(eq=False)
class _Live:
    """A request streaming through this gateway."""

    call: grpc.aio.UnaryStreamCall
    tenant: str = ""          # whose request it is (only that tenant may abort it)
    aborted: bool = False     # set by the Abort RPC


class LLMServicer:
    """``kvmesh.v1.LLMService``. ``info`` (the scheduler's GetModelInfo) and ``text`` (tokenizer
    front end) are None until :func:`serve_gateway` has reached the scheduler."""

    def __init__(self, cfg: GatewayConfig, channel: grpc.aio.Channel):
        self.cfg, self.channel = cfg, channel
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self.info: scheduler_pb2.GetModelInfoResponse | None = None
        self.text = None                      # kvmesh.llm._TextFront with the model's tokenizer
        self.model_names: set[str] = set()
        self.live: dict[str, _Live] = {}
        self.tracer = telemetry.setup_tracing(telemetry.GATEWAY)    # no-op unless OTEL_TRACES_EXPORTER is set
        from kvmesh.metrics import GatewayMetrics
        self.metrics = GatewayMetrics(self)

    def set_model(self, info: scheduler_pb2.GetModelInfoResponse, tokenizer) -> None:
        from kvmesh.llm import _TextFront
        from workers.registry import canonical_name
        text = _TextFront()
        text.tokenizer = tokenizer
        self.text, self.info = text, info
        self.model_names = {info.name} | ({canonical_name(info.name)} - {None})

    # ---- RPCs ------------------------------------------------------------------------------
    @_rpc
    async def Generate(self, request: llm_pb2.GenerateRequest, context) -> None:
        with self._span("generate", "text_completion", request, context):
            self._check_model(request.model)
            self._check_limits(request)
            kind = request.WhichOneof("input")
            if kind == "prompt":      # tokenized off the event loop: a huge prompt must not stall other streams
                _, prompt_ids = await asyncio.to_thread(self.text.encode_prompt, request.prompt)  # EngineError if empty
            elif kind == "prompt_token_ids":
                self._check_prompt_len(len(request.prompt_token_ids.ids))     # before reading them
                prompt_ids = self._check_ids(list(request.prompt_token_ids.ids))
            else:
                raise _invalid("prompt: a prompt or prompt_token_ids is required")
            await self._stream(request, prompt_ids, context)

    @_rpc
    async def Chat(self, request: llm_pb2.ChatRequest, context) -> None:
        with self._span("chat", "chat", request, context):
            self._check_model(request.model)
            self._check_limits(request)
            await self._stream(request, await asyncio.to_thread(self._encode_chat, request.messages), context)

    def _span(self, name: str, operation: str, request, context):
        """The request's SERVER span ``kvmesh.gateway.<name>``, current while the RPC runs: a
        child of the caller's span when its metadata carries a W3C ``traceparent``, else a root."""
        return self.tracer.start_as_current_span(
            f"kvmesh.gateway.{name}", context=telemetry.extract_metadata(context.invocation_metadata()),
            kind=trace.SpanKind.SERVER, attributes={
                "gen_ai.operation.name": operation, "gen_ai.request.model": request.model or self.info.name,
                "kvmesh.request_id": request.request_id, "kvmesh.session_id": request.session_id,
                "kvmesh.tenant": CURRENT_TENANT.get()})

    @_rpc
    async def Abort(self, request: llm_pb2.AbortRequest, context) -> llm_pb2.AbortResponse:
        rid = request.request_id
        if not rid:
            raise _invalid("request_id: required")
        live, tenant = self.live.get(rid), CURRENT_TENANT.get()
        if live is not None and live.tenant == tenant:
            live.aborted = True
            live.call.cancel()
            return llm_pb2.AbortResponse(found=True)
        if live is not None:                # another tenant's request: as if unknown
            return llm_pb2.AbortResponse(found=False)
        try:
            r = await self.stub.Abort(scheduler_pb2.SchedulerAbortRequest(request_id=rid, tenant=tenant),
                                      timeout=_ABORT_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            raise self._upstream_status(e) from None
        return llm_pb2.AbortResponse(found=r.found)

    @_rpc
    async def ListModels(self, request, context) -> llm_pb2.ListModelsResponse:
        i = self.info
        return llm_pb2.ListModelsResponse(models=[llm_pb2.ModelInfo(
            name=i.name, max_model_len=i.max_model_len, vocab_size=i.vocab_size, dtype=i.dtype)])

    @_rpc
    async def Tokenize(self, request: llm_pb2.TokenizeRequest, context) -> llm_pb2.TokenizeResponse:
        self._check_model(request.model)
        kind = request.WhichOneof("input")
        if kind == "prompt":
            _, ids = await asyncio.to_thread(self.text.encode_prompt, request.prompt)
        elif kind == "chat":
            ids = await asyncio.to_thread(self._encode_chat, request.chat.messages)
        else:
            raise _invalid("prompt: a prompt or chat is required")
        return llm_pb2.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=self.info.max_model_len)

    # ---- validation ------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model and model not in self.model_names:
            raise _invalid(f"model: unknown model {model!r}; this gateway serves {self.info.name!r}")

    def _check_limits(self, request) -> None:
        """The request limits that need no tokenizer (GatewayConfig: ids, stop lists): lengths
        only, so that an oversize request costs nothing more."""
        c = self.cfg
        for name in ("request_id", "session_id", "cache_salt"):
            if (n := len(getattr(request, name))) > c.max_id_length:
                raise _invalid(f"{name}: {n} characters exceeds max_id_length ({c.max_id_length})")
        sp = request.sampling
        if len(sp.stop) > c.max_stop_strings:
            raise _invalid(f"sampling.stop: {len(sp.stop)} stop strings exceeds max_stop_strings "
                           f"({c.max_stop_strings})")
        if (n := sum(map(len, sp.stop))) > c.max_stop_chars:
            raise _invalid(f"sampling.stop: {n} characters in all exceeds max_stop_chars ({c.max_stop_chars})")
        if len(sp.stop_token_ids) > c.max_stop_token_ids:
            raise _invalid(f"sampling.stop_token_ids: {len(sp.stop_token_ids)} ids exceeds max_stop_token_ids "
                           f"({c.max_stop_token_ids})")

    def _check_prompt_len(self, n: int) -> None:
        """``max_prompt_tokens``, and room for one output token within ``max_model_len``."""
        limit, mml = self.cfg.max_prompt_tokens, self.info.max_model_len
        if limit and n > limit:
            raise _invalid(f"prompt: {n} tokens exceeds max_prompt_tokens ({limit})")
        if n >= mml:
            raise _invalid(f"prompt: {n} tokens leave no room for output within max_model_len {mml}")

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise _invalid("prompt_token_ids: empty")
        bad = next((t for t in ids if t >= self.info.vocab_size), None)
        if bad is not None:
            raise _invalid(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.info.vocab_size})")
        return ids

    def _encode_chat(self, messages) -> list[int]:
        """Chat messages → prompt token ids with the model's chat template."""
        if not messages:
            raise _invalid("messages: at least one message is required")
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise _invalid(f"messages[{i}].role: unknown role {m.role!r} (expected one of {', '.join(ROLES)})")
        return self.text.encode_chat([{"role": m.role, "content": m.content} for m in messages])

    def _sampling(self, msg: common_pb2.SamplingParams, n_prompt: int
                  ) -> tuple[common_pb2.SamplingParams, SamplingParams]:
        """Apply the max_tokens rules (module docstring) and validate. Returns the message to
        forward (max_tokens set, stop strings removed: they are the gateway's) and the engine
        params (with the stop strings)."""
        from scheduler.service import sampling_params_from_proto
        limit = self.info.max_model_len
        room = limit - n_prompt             # >= 1: _check_prompt_len
        fwd = common_pb2.SamplingParams()
        fwd.CopyFrom(msg)
        if fwd.HasField("max_tokens"):
            asked = fwd.max_tokens
            fwd.max_tokens = min(asked, self.cfg.max_tokens_cap)
            if fwd.max_tokens > room:
                capped = f", capped to {fwd.max_tokens}" if asked > fwd.max_tokens else ""
                raise _invalid(f"max_tokens: prompt ({n_prompt} tokens) + max_tokens ({asked}{capped}) "
                               f"exceeds max_model_len {limit}; at most {room} tokens fit")
        else:
            fwd.max_tokens = min(self.cfg.default_max_tokens, self.cfg.max_tokens_cap, room)
        try:
            params = sampling_params_from_proto(fwd)
        except EngineError as e:
            raise _invalid(f"sampling: {e}") from None
        fwd.ClearField("stop")
        return fwd, params

    def _timeout(self, request, context) -> float:
        """The request's deadline in seconds (module docstring)."""
        if request.HasField("timeout"):
            t = request.timeout.seconds + request.timeout.nanos / 1e9
            if t <= 0:
                raise _invalid(f"timeout: must be > 0 seconds, got {t:g}")
            if t > self.cfg.max_timeout:
                raise _invalid(f"timeout: {t:g} s exceeds the gateway's max_timeout of {self.cfg.max_timeout:g} s")
        else:
            t = self.cfg.default_timeout
        left = context.time_remaining()
        return t if left is None else min(t, left)

    # ---- streaming -------------------------------------------------------------------------
    async def _stream(self, request, prompt_ids: list[int], context: grpc.aio.ServicerContext) -> None:
        """Submit one validated request upstream and stream its messages to ``context``."""
        rid = request.request_id or uuid.uuid4().hex
        self._check_prompt_len(len(prompt_ids))
        fwd, params = self._sampling(request.sampling, len(prompt_ids))
        timeout = self._timeout(request, context)
        # the stop strings' automaton costs O(their characters): built off the event loop
        make_detok = functools.partial(IncrementalDetokenizer, self.text.tokenizer, prompt_ids, stop=params.stop,
                                       skip_special_tokens=params.skip_special_tokens)
        detok = await asyncio.to_thread(make_detok) if params.stop else make_detok()
        if rid in self.live:
            raise _Status(_Code.ALREADY_EXISTS, f"request_id: {rid!r} is already in flight")
        trailers = (("kvmesh-max-tokens", str(fwd.max_tokens)),)
        context.set_trailing_metadata(trailers)
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"kvmesh.request_id": rid, "gen_ai.request.max_tokens": fwd.max_tokens,
                                 "gen_ai.request.temperature": params.temperature,
                                 "gen_ai.usage.input_tokens": len(prompt_ids)})
        t0 = time.monotonic()
        t_first = None
        tenant = CURRENT_TENANT.get()
        call = self.stub.Submit(scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                                            sampling=fwd, session_id=request.session_id,
                                                            cache_salt=cache_salt(tenant, request.cache_salt),
                                                            tenant=tenant),
                                timeout=timeout, metadata=telemetry.inject_metadata(span))
        live = self.live[rid] = _Live(call, tenant)
        usage = common_pb2.Usage()      # what the scheduler reported so far (cached tokens, speculation)
        try:
            try:
                async for up in call:
                    if t_first is None and up.token_ids:
                        t_first = time.monotonic()
                        self.metrics.first_token(t_first - t0, tenant)
                    if up.HasField("usage"):
                        usage.MergeFrom(up.usage)
                    delta, ids = _add_tokens(detok, up.token_ids)
                    out = llm_pb2.GenerateResponse(request_id=rid, text=delta.text, token_ids=ids)
                    if params.logprobs is not None:
                        out.logprobs.extend(up.logprobs)
                    if delta.stop_string is not None:       # end upstream now, report STOP
                        self._end_upstream(rid, live)       # the id is free before the client has the end
                        _finish(out, common_pb2.FINISH_REASON_STOP, delta.stop_string,
                                _usage(usage, prompt_ids, detok), _timings(up, t0, t_first))
                    elif up.finished:
                        out.text += detok.flush()
                        if detok.stop_string is not None:   # matched in the flushed tail
                            _finish(out, common_pb2.FINISH_REASON_STOP, detok.stop_string, up.usage, up.timings)
                        else:
                            _finish(out, up.finish_reason, up.stop_reason, up.usage, up.timings)
                    if out.token_ids or out.text or out.finished:
                        await context.write(out)
                    if out.finished:
                        _span_finished(span, out, up.replica)
                        self.metrics.usage(out.usage, tenant)
                        return
            except asyncio.CancelledError:
                # the Abort RPC cancelled the upstream call (not grpc cancelling this handler)
                if not live.aborted or asyncio.current_task().cancelling():
                    raise
                out = llm_pb2.GenerateResponse(request_id=rid, text=detok.flush())
                _finish(out, common_pb2.FINISH_REASON_ABORT, "", _usage(usage, prompt_ids, detok),
                        _timings(None, t0, t_first))
                _span_finished(span, out, None)
                self.metrics.usage(out.usage, tenant)
                await context.write(out)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == _Code.DEADLINE_EXCEEDED:
                    context.set_trailing_metadata(trailers + (
                        ("kvmesh-usage-bin", _usage(usage, prompt_ids, detok).SerializeToString()),))
                    raise _Status(_Code.DEADLINE_EXCEEDED, f"request {rid}: deadline of {timeout:.3g} s exceeded "
                                                           "(the request was aborted)") from None
                raise self._upstream_status(e) from None
            raise _Status(_Code.UNAVAILABLE, f"the scheduler at {self.cfg.scheduler_address} ended request "
                                             f"{rid} without a final message")
        finally:
            self._end_upstream(rid, live)

    def _end_upstream(self, rid: str, live: _Live) -> None:
        """Cancel the upstream call (a no-op when it finished; else the scheduler aborts the
        request) and free the id. Idempotent."""
        live.call.cancel()
        if self.live.get(rid) is live:
            del self.live[rid]

    def _upstream_status(self, e: grpc.aio.AioRpcError) -> _Status:
        """The status to answer for a failed scheduler call: the scheduler's own status as is,
        UNAVAILABLE 'scheduler at ADDR unreachable: ...' for a connection failure, UNAVAILABLE for
        a call the scheduler cancelled (it was shutting down: retry elsewhere)."""
        details = e.details() or e.code().name
        if e.code() == _Code.UNAVAILABLE and (
                any(s in details.lower() for s in _CONNECTION_ERRORS)
                or self.channel.get_state() != grpc.ChannelConnectivity.READY):
            return _Status(_Code.UNAVAILABLE, f"scheduler at {self.cfg.scheduler_address} unreachable: {details}")
        if e.code() == _Code.CANCELLED:    # the scheduler dropped the call (we cancel ours differently)
            return _Status(_Code.UNAVAILABLE, f"scheduler at {self.cfg.scheduler_address} cancelled the "
                                              f"request: {details}")
        return _Status(e.code(), details)

    def cancel_all(self) -> None:
        """Cancel every upstream call (server shutdown)."""
        for live in list(self.live.values()):
            live.call.cancel()


def _finish(out: llm_pb2.GenerateResponse, reason: int, stop_reason: str,
            usage: common_pb2.Usage, timings: common_pb2.Timings) -> None:
    out.finished, out.finish_reason, out.stop_reason = True, reason, stop_reason
    out.usage.CopyFrom(usage)
    out.timings.CopyFrom(timings)


def _span_finished(span, out: llm_pb2.GenerateResponse, replica: int | None) -> None:
    """The request span's attributes from the final message."""
    if not span.is_recording():
        return
    reason = common_pb2.FinishReason.Name(out.finish_reason).removeprefix("FINISH_REASON_").lower()
    span.set_attributes({"gen_ai.response.finish_reasons": [reason], "kvmesh.finish_reason": reason,
                         "gen_ai.usage.input_tokens": out.usage.prompt_tokens,
                         "gen_ai.usage.output_tokens": out.usage.completion_tokens,
                         "kvmesh.prefix_cache.hit_tokens": out.usage.cached_prompt_tokens,
                         "kvmesh.ttft_s": out.timings.ttft, "kvmesh.e2e_latency_s": out.timings.e2e_latency})
    if out.stop_reason:
        span.set_attribute("kvmesh.stop_reason", out.stop_reason)
    if replica is not None:
        span.set_attribute("kvmesh.replica", replica)


def _add_tokens(detok: IncrementalDetokenizer, token_ids) -> tuple[DetokenizerDelta, list[int]]:
    """Feed a message's token ids one at a time: with speculative decoding one message may
    carry several, and a stop string completing inside them ends the output at that token
    (the ids after it are dropped, as their text is). Returns the delta and the ids kept."""
    text, ids = [], []
    for t in token_ids:
        d = detok.add_tokens([t])
        text.append(d.text)
        ids.append(t)
        if d.stop_string is not None:
            return DetokenizerDelta("".join(text), d.stop_string), ids
    return DetokenizerDelta("".join(text), None), ids


def _usage(known: common_pb2.Usage, prompt_ids: list[int], detok: IncrementalDetokenizer) -> common_pb2.Usage:
    """Usage of a request the gateway ended (stop string, Abort): the cached prompt tokens and
    speculation counts the scheduler reported so far (``known``), the tokens it received."""
    usage = common_pb2.Usage()
    usage.CopyFrom(known)
    usage.prompt_tokens, usage.completion_tokens = len(prompt_ids), detok.num_output_tokens
    return usage


def _timings(up, t0: float, t_first: float | None) -> common_pb2.Timings:
    """Timings (seconds) of a request the gateway ended, on its own clock from Submit; the
    scheduler's queue time and ttft when its message carried them."""
    now = time.monotonic()
    if up is not None and up.HasField("timings"):
        queue, ttft = up.timings.queue_time, up.timings.ttft
    else:
        queue, ttft = 0.0, (t_first - t0 if t_first else 0.0)
    return common_pb2.Timings(queue_time=queue, ttft=ttft, decode_time=now - t_first if t_first else 0.0,
                              e2e_latency=now - t0)


# ---- server ---------------------------------------------------------------------------------------

def _add_servicer(servicer: LLMServicer, server: grpc.aio.Server) -> None:
    """Register like the generated ``add_LLMServiceServicer_to_server``, with lenient deserializers."""
    methods = {"Generate": (grpc.unary_stream_rpc_method_handler, llm_pb2.GenerateRequest, llm_pb2.GenerateResponse),
               "Chat": (grpc.unary_stream_rpc_method_handler, llm_pb2.ChatRequest, llm_pb2.GenerateResponse),
               "Abort": (grpc.unary_unary_rpc_method_handler, llm_pb2.AbortRequest, llm_pb2.AbortResponse),
               "ListModels": (grpc.unary_unary_rpc_method_handler, llm_pb2.ListModelsRequest,
                              llm_pb2.ListModelsResponse),
               "Tokenize": (grpc.unary_unary_rpc_method_handler, llm_pb2.TokenizeRequest, llm_pb2.TokenizeResponse)}
    handlers = {name: make(getattr(servicer, name), request_deserializer=_lenient(req, servicer.cfg.max_message_bytes),
                           response_serializer=resp.SerializeToString)
                for name, (make, req, resp) in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class GatewayServer:
    """A running gateway. ``port`` is the bound port, ``address`` is ``host:port``; ``metrics`` is
    its Prometheus endpoint (:class:`kvmesh.metrics.MetricsServer`), None when off; ``api_keys``
    its :class:`gateway.auth.ApiKeys` (None: no keys needed)."""

    def __init__(self, server: grpc.aio.Server, servicer: LLMServicer, health_servicer, host: str, port: int,
                 api_keys: ApiKeys | None = None):
        self.server, self.servicer, self.health = server, servicer, health_servicer
        self.host, self.port, self.address = host, port, f"{host}:{port}"
        self.api_keys = api_keys
        self.metrics = None
        self.health_server = None           # the plaintext health-only port (kvmesh.tls), None when off
        self._watch_task: asyncio.Task | None = None
        self._stopped = False

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _watch_scheduler(self) -> None:
        """Keep a connection to the scheduler and mirror it in health: NOT_SERVING while the
        channel is failing, SERVING again once it is ready."""
        channel, C = self.servicer.channel, grpc.ChannelConnectivity
        while True:
            state = channel.get_state(try_to_connect=True)
            if state == C.READY:
                await self._set_health(_SERVING)
            elif state in (C.TRANSIENT_FAILURE, C.SHUTDOWN):
                await self._set_health(_NOT_SERVING)
            await channel.wait_for_state_change(state)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self, grace: float | None = 5.0) -> None:
        """Go NOT_SERVING, refuse new RPCs, give in-flight streams ``grace`` seconds (None = wait
        for them), cancel those still running (their upstream calls are cancelled, so the
        scheduler aborts them), close the channel to the scheduler. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)
        self.servicer.cancel_all()
        await self.servicer.channel.close()
        await asyncio.to_thread(telemetry.shutdown_tracing, telemetry.GATEWAY)   # exports the last spans
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)


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
                raise EngineError(f"scheduler at {cfg.scheduler_address} answered GetModelInfo with {last}") from None
        await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))
    raise EngineError(f"scheduler at {cfg.scheduler_address} unreachable after {cfg.connect_timeout:g} s: {last}")


async def serve_gateway(cfg: GatewayConfig) -> GatewayServer:
    """Start the gateway on ``cfg.host:cfg.port`` (port 0 = a free port) and return once it serves.

    The port is bound first (health NOT_SERVING, RPCs UNAVAILABLE meanwhile); then the scheduler
    at ``cfg.scheduler_address`` is awaited (GetModelInfo, up to ``cfg.connect_timeout`` seconds),
    the served model's tokenizer is loaded (``workers.registry.resolve_model`` of the scheduler's
    model name: a known name, pulled if missing, or a directory that must exist here too), and
    health turns SERVING. Prometheus metrics on ``cfg.host:metrics_port`` when it is not -1
    (:mod:`kvmesh.metrics`). API keys and TLS: module docstring.

    Raises:
        EngineError: the address cannot be bound; the scheduler is unreachable within
            ``connect_timeout``; the model's tokenizer cannot be found; a keys file or a TLS
            file cannot be read or parsed. The server is stopped.
    """
    from kvmesh import tls
    from kvmesh.llm import _load_tokenizer
    from workers.registry import resolve_model

    cfg.check_tls()
    keys = ApiKeys.load(cfg.api_keys_file)
    server_creds = tls.server_credentials(cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file else None
    if cfg.scheduler_tls_ca_file:
        channel = grpc.aio.secure_channel(cfg.scheduler_address, tls.channel_credentials(
            cfg.scheduler_tls_ca_file, cfg.scheduler_tls_client_cert_file, cfg.scheduler_tls_client_key_file,
            prefix="scheduler_"), options=_CHANNEL_OPTIONS + tls.server_name_option(cfg.scheduler_tls_server_name))
    else:
        channel = grpc.aio.insecure_channel(cfg.scheduler_address, options=_CHANNEL_OPTIONS)
    servicer = LLMServicer(cfg, channel)
    interceptors = []
    if keys is not None:
        interceptors.append(ApiKeyInterceptor(keys, (health.SERVICE_NAME, reflection.SERVICE_NAME),
                                              on_denied=servicer.metrics.denied))
    # so_reuseport=0: a second server on a port in use fails instead of sharing it. Requests up
    # to twice max_message_bytes reach the deserializer, which names the limit (INVALID_ARGUMENT).
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", 2 * cfg.max_message_bytes)],
                             interceptors=interceptors)
    _add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    addr = f"{cfg.host}:{cfg.port}"
    try:
        port = server.add_secure_port(addr, server_creds) if server_creds else server.add_insecure_port(addr)
    except RuntimeError as e:           # grpc raises "Failed to bind to address ..."
        await channel.close()
        raise EngineError(f"cannot listen on {addr} ({e}): is the port in use? choose another port "
                          "(0 = any free port)") from None
    gw = GatewayServer(server, servicer, health_servicer, cfg.host, port, keys)
    from kvmesh.metrics import start_metrics_server
    try:
        gw.metrics = start_metrics_server(servicer.metrics.registry, cfg.host, cfg.metrics_port)
        gw.health_server = await tls.serve_health_port(health_servicer, cfg.host, cfg.health_port)
    except EngineError:
        if gw.metrics is not None:
            gw.metrics.stop()
        await channel.close()
        raise
    await gw._set_health(_NOT_SERVING)
    await server.start()
    try:
        info = await _wait_for_scheduler(servicer.stub, cfg)
        tokenizer = await asyncio.to_thread(lambda: _load_tokenizer(resolve_model(info.name)))
    except BaseException:
        await gw.stop(0)
        raise
    servicer.set_model(info, tokenizer)
    await gw._set_health(_SERVING)
    gw._watch_task = asyncio.create_task(gw._watch_scheduler())
    log.info("gateway serving %s on %s (scheduler %s)%s%s", info.name, gw.address, cfg.scheduler_address,
             ", TLS" if server_creds else "", f", API keys of {len(keys.tenants)} tenant(s)" if keys else "")
    return gw
