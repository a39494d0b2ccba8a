"""The gateway's protocol-neutral request path, shared by the gRPC servicer (:mod:`gateway.server`)
and the OpenAI-compatible HTTP API (:mod:`gateway.http_api`).

A front end turns its request into a ``kvmesh.v1`` ``GenerateRequest`` or ``ChatRequest`` and
calls :class:`RequestPath`: :meth:`~RequestPath.check_model` and
:meth:`~RequestPath.check_limits` (no tokenizer) → :meth:`~RequestPath.prompt_ids` (the prompt or
the chat template, tokenized off the event loop) → :meth:`~RequestPath.prepare` (prompt length,
``max_tokens`` rules, deadline, the request's :class:`~gateway.output_processor.OutputProcessor`
with its stop strings) → :meth:`~RequestPath.stream` (``Submit`` to the scheduler; an async
iterator of ``GenerateResponse`` messages: text deltas, token ids, logprobs, and a final message
with finish reason, usage and timings, all from the output processor, which the offline API
uses too). Every failure is a :class:`Status` (a gRPC status code and a message naming the
field); the gRPC servicer answers it as is, the HTTP API maps it to an HTTP status and OpenAI's
error body. The rules a client sees are listed in :mod:`gateway.server`'s docstring.

The caller's tenant (:data:`gateway.auth.CURRENT_TENANT`, set by the front end's API key check)
is read in :meth:`~RequestPath.span` and :meth:`~RequestPath.prepare`: it labels the request's
span and metrics, and with the request's ``cache_salt`` it makes the salt the scheduler gets
(:func:`gateway.auth.cache_salt`), so tenants never share cached KV blocks. Request ids are the
tenant's own: a request in flight is known by (tenant, request id), here and in the scheduler
(``SubmitRequest.tenant``), so another tenant's live id is free to use (its own request) and
tells nothing about the first tenant's; :meth:`~RequestPath.abort` finds only the caller's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from gateway.auth import CURRENT_TENANT, cache_salt
from gateway.output_processor import OutputProcessor, RequestMetrics
from gateway.text import TextFront
from kvmesh.core import telemetry
from kvmesh.core.errors import EngineError
from kvmesh.core.proto import finish_reason_name, finish_reason_to_proto, sampling_params_from_proto
from kvmesh.core.sampling import SamplingParams
from kvmesh.core.service_config import GatewayConfig
from kvmesh.core.status import retry_hint
from kvmesh.v1 import common_pb2, llm_pb2, scheduler_pb2, scheduler_pb2_grpc

ROLES = ("system", "user", "assistant")
_Code = grpc.StatusCode
# Failures grpc-core reports for a connection (not statuses a scheduler sends itself).
_CONNECTION_ERRORS = ("failed to connect", "connections to all backends failing", "socket closed",
                      "connection reset", "connection refused", "broken pipe", "goaway", "endpoint closing")
ABORT_TIMEOUT = 10.0      # seconds for a forwarded Abort
RETRY_AFTER = 1.0         # seconds: the retry hint of a request the gateway refuses or ends as it shuts down
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*):")      # "messages[1].role: ..."
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")     # not in ids: they reach logs and HTTP headers


_FROM_MESSAGE = object()
SHOWN_CHARS = 64          # characters of a client's value quoted back in an error message


def shown(value: str) -> str:
    """``repr(value)`` for an error message, cut to its first SHOWN_CHARS characters (with the
    length) when longer: a message never quotes a client's megabyte back (in gRPC it is a
    header, and a client refuses one over 8 KiB)."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"


class Status(Exception):
    """End the request with this gRPC status ``code`` and ``message``. ``param``: the request
    field the message names (``max_tokens``, ``stop``, ``messages[1].role``, ``temperature``), None when
    none; by default read from the message's start, else as given. ``usage``: the usage so far of
    a request whose deadline passed (or that the gateway's shutdown ended). ``retry_after``:
    seconds after which the request may be sent again (the gRPC servicer sends it as the
    trailing metadata ``grpc-retry-pushback-ms``, the HTTP API as ``Retry-After``), None: no hint."""

    def __init__(self, code: grpc.StatusCode, message: str, usage: common_pb2.Usage | None = None,
                 param=_FROM_MESSAGE, retry_after: float | None = None):
        super().__init__(message)
        self.code, self.message, self.usage = code, message, usage
        self._param = param
        self.retry_after = retry_after

    @property
    def param(self) -> str | None:
        if self._param is not _FROM_MESSAGE:
            return self._param
        if self.code != _Code.INVALID_ARGUMENT:
            return None
        m = _FIELD.match(self.message)
        if m is None:
            return None
        name = m.group(1)
        if name == "sampling":          # "sampling: temperature must be >= 0, got -1"
            word = self.message.split(":", 1)[1].split()
            return word[0] if word else name
        return name.removeprefix("sampling.")


def _ids_given(request) -> bool:
    """Whether ``request`` is a ``GenerateRequest`` whose prompt is token ids (whose length
    :meth:`RequestPath.prompt_ids` checks)."""
    return isinstance(request, llm_pb2.GenerateRequest) and request.WhichOneof("input") == "prompt_token_ids"


def invalid(message: str, param=_FROM_MESSAGE) -> Status:
    return Status(_Code.INVALID_ARGUMENT, message, param=param)


@dataclass(eq=False)
class _Live:
    """A request streaming through this gateway."""

    call: grpc.aio.UnaryStreamCall
    aborted: bool = False     # set by an Abort
    ended: str = ""           # set by the gateway's shutdown: why it cancelled the request


@dataclass(eq=False)
class Prepared:
    """A validated request, ready for :meth:`RequestPath.stream`. ``forward``: the sampling
    message sent upstream (``max_tokens`` set, stop strings removed); ``params``: the engine's
    view of it (with the stop strings); ``timeout``: the deadline in seconds; ``output``: its
    output processor (text, stop strings, usage, timings); ``tenant``: the caller's;
    ``cache_salt``: what the scheduler gets (:func:`gateway.auth.cache_salt` of the tenant and the
    request's ``cache_salt``)."""

    request_id: str
    session_id: str
    prompt_ids: list[int]
    forward: common_pb2.SamplingParams
    params: SamplingParams
    timeout: float
    output: OutputProcessor
    tenant: str = ""
    cache_salt: str = ""


class RequestPath:
    """Validation, tokenizing and streaming of requests to the scheduler at ``cfg.scheduler_address``
    over ``channel``. ``info`` (the scheduler's GetModelInfo) and ``text`` (tokenizer front end)
    are None until :meth:`set_model`; ``live`` holds the requests in flight by (tenant, request
    id): ids are per tenant; ``serving`` is
    the gateway's readiness (True while the scheduler it follows reports SERVING:
    :mod:`gateway.server`). ``active`` counts the requests of both fronts between
    :meth:`admitted`'s start and end; ``draining`` is set by :meth:`drain` (the gateway's stop)."""

    def __init__(self, cfg: GatewayConfig, channel: grpc.aio.Channel):
        self.cfg, self.channel = cfg, channel
        self.stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self.info: scheduler_pb2.GetModelInfoResponse | None = None
        self.text: TextFront | None = None    # the model's tokenizer front
        self.model_names: set[str] = set()
        self.live: dict[tuple[str, str], _Live] = {}
        self.serving = False
        self.draining = False
        self.ended = ""                     # why requests end now (the shutdown, once the drain's grace ran out)
        self.active = 0
        self._idle = asyncio.Event()        # set while no request is admitted
        self._idle.set()
        self.tracer = telemetry.setup_tracing(telemetry.GATEWAY)    # no-op unless OTEL_TRACES_EXPORTER is set
        from kvmesh.core.metrics import GatewayMetrics
        self.metrics = GatewayMetrics(self)

    def set_model(self, info: scheduler_pb2.GetModelInfoResponse, tokenizer) -> None:
        from kvmesh.hub.manifest import canonical_name
        text = TextFront()
        text.tokenizer = tokenizer
        self.text, self.info = text, info
        self.model_names = {info.name} | ({canonical_name(info.name)} - {None})

    def check_ready(self) -> None:
        """Status UNAVAILABLE while the gateway has not reached the scheduler yet."""
        if self.info is None:
            raise Status(_Code.UNAVAILABLE, f"the gateway is starting: waiting for the scheduler at "
                                            f"{self.cfg.scheduler_address}")

    @contextlib.contextmanager
    def admitted(self):
        """One request of either front, from its start to its end: counted in ``active`` (what
        :meth:`drain` waits for). Raises Status UNAVAILABLE with a retry hint
        (:data:`RETRY_AFTER` seconds) once the gateway drains: the request was not started, so
        the client can send it again, to another gateway."""
        if self.draining:
            raise Status(_Code.UNAVAILABLE, "the gateway is shutting down (draining its requests in flight): the "
                                            "request was not started; retry it, on another gateway",
                         retry_after=RETRY_AFTER)
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if not self.active:
                self._idle.set()

    async def drain(self, grace: float | None) -> int:
        """Refuse new requests (:meth:`admitted`) and wait for the admitted ones to end, up to
        ``grace`` seconds (None: however long they take). Returns how many still run."""
        self.draining = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace)
        return self.active

    async def end_all(self, reason: str, timeout: float = 10.0) -> int:
        """End every admitted request now: each in flight upstream has its upstream call cancelled
        (the scheduler aborts it) and ends with Status UNAVAILABLE ``request R: <reason> after N
        tokens; retry it`` with a retry hint and its usage so far; one not yet submitted ends so at
        its submit. Waits up to ``timeout`` seconds for them to end; returns how many still run."""
        self.draining = True
        self.ended = reason
        for live in list(self.live.values()):
            live.ended = reason
            live.call.cancel()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self.active

    def span(self, name: str, operation: str, request, carrier: Iterable | None):
        """The request's SERVER span ``kvmesh.gateway.<name>``, current while the request runs: a
        child of the caller's span when ``carrier`` (gRPC metadata or HTTP headers, (key, value)
        pairs) holds a W3C ``traceparent``, else a root."""
        return self.tracer.start_as_current_span(
            f"kvmesh.gateway.{name}", context=telemetry.extract_metadata(carrier),
            kind=trace.SpanKind.SERVER, attributes={
                "gen_ai.operation.name": operation, "gen_ai.request.model": request.model or self.info.name,
                "kvmesh.request_id": request.request_id, "kvmesh.session_id": request.session_id,
                "kvmesh.tenant": CURRENT_TENANT.get()})

    # ---- validation ------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model and model not in self.model_names:
            raise invalid(f"model: unknown model {shown(model)}; this gateway serves {self.info.name!r}")

    def check_limits(self, request) -> None:
        """The request limits that need no tokenizer (GatewayConfig: ids, stop lists): lengths
        (and no control characters in the ids), so that an oversize request costs nothing more."""
        c = self.cfg
        for name in ("request_id", "session_id", "cache_salt"):
            if (n := len(value := getattr(request, name))) > c.max_id_length:
                raise invalid(f"{name}: {n} characters exceeds max_id_length ({c.max_id_length})")
            if _CONTROL.search(value):
                raise invalid(f"{name}: control characters (U+0000-U+001F, U+007F-U+009F) are not allowed")
        sp = request.sampling
        if len(sp.stop) > c.max_stop_strings:
            raise invalid(f"sampling.stop: {len(sp.stop)} stop strings exceeds max_stop_strings "
                          f"({c.max_stop_strings})")
        if (n := sum(map(len, sp.stop))) > c.max_stop_chars:
            raise invalid(f"sampling.stop: {n} characters in all exceeds max_stop_chars ({c.max_stop_chars})")
        if len(sp.stop_token_ids) > c.max_stop_token_ids:
            raise invalid(f"sampling.stop_token_ids: {len(sp.stop_token_ids)} ids exceeds max_stop_token_ids "
                          f"({c.max_stop_token_ids})")

    async def prompt_ids(self, request: llm_pb2.GenerateRequest | llm_pb2.ChatRequest) -> list[int]:
        """The prompt token ids of a request: a text prompt or a conversation (chat template)
        tokenized off the event loop (a huge prompt must not stall other streams), or the
        request's own ids, checked against the vocabulary."""
        if isinstance(request, llm_pb2.ChatRequest):
            return await asyncio.to_thread(self.encode_chat, request.messages)
        kind = request.WhichOneof("input")
        if kind == "prompt":
            _, ids = await asyncio.to_thread(self.text.encode_prompt, request.prompt)  # EngineError if empty
            return ids
        if kind == "prompt_token_ids":
            self.check_prompt_len(len(request.prompt_token_ids.ids))     # before reading them
            return self._check_ids(list(request.prompt_token_ids.ids))
        raise invalid("prompt: a prompt or prompt_token_ids is required")

    def check_prompt_len(self, n: int) -> None:
        """``max_prompt_tokens``, and room for one output token within ``max_model_len``."""
        limit, mml = self.cfg.max_prompt_tokens, self.info.max_model_len
        if limit and n > limit:
            raise invalid(f"prompt: {n} tokens exceeds max_prompt_tokens ({limit})")
        if n >= mml:
            raise invalid(f"prompt: {n} tokens leave no room for output within max_model_len {mml}")

    def _check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise invalid("prompt_token_ids: empty")
        bad = next((t for t in ids if t >= self.info.vocab_size), None)
        if bad is not None:
            raise invalid(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {self.info.vocab_size})")
        return ids

    def encode_chat(self, messages) -> list[int]:
        """Chat messages → prompt token ids with the model's chat template."""
        if not messages:
            raise invalid("messages: at least one message is required")
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise invalid(f"messages[{i}].role: unknown role {shown(m.role)} (expected one of {', '.join(ROLES)})")
        return self.text.encode_chat([{"role": m.role, "content": m.content} for m in messages])

    def _sampling(self, msg: common_pb2.SamplingParams, n_prompt: int
                  ) -> tuple[common_pb2.SamplingParams, SamplingParams]:
        """Apply the max_tokens rules (gateway.server's docstring) and validate. Returns the
        message to forward (max_tokens set, stop strings removed: they are the gateway's) and the
        engine params (with the stop strings)."""
        limit = self.info.max_model_len
        room = limit - n_prompt             # >= 1: check_prompt_len
        fwd = common_pb2.SamplingParams()
        fwd.CopyFrom(msg)
        if fwd.HasField("max_tokens"):
            asked = fwd.max_tokens
            fwd.max_tokens = min(asked, self.cfg.max_tokens_cap)
            if fwd.max_tokens > room:
                capped = f", capped to {fwd.max_tokens}" if asked > fwd.max_tokens else ""
                raise invalid(f"max_tokens: prompt ({n_prompt} tokens) + max_tokens ({asked}{capped}) "
                              f"exceeds max_model_len {limit}; at most {room} tokens fit")
        else:
            fwd.max_tokens = min(self.cfg.default_max_tokens, self.cfg.max_tokens_cap, room)
        try:
            params = sampling_params_from_proto(fwd)
        except EngineError as e:
            raise invalid(f"sampling: {e}") from None
        fwd.ClearField("stop")
        return fwd, params

    def _timeout(self, request, time_left: float | None) -> float:
        """The request's deadline in seconds: its ``timeout`` (default ``default_timeout``, at most
        ``max_timeout``), at most ``time_left`` (the client's own deadline; None = none)."""
        if request.HasField("timeout"):
            t = request.timeout.seconds + request.timeout.nanos / 1e9
            if t <= 0:
                raise invalid(f"timeout: must be > 0 seconds, got {t:g}")
            if t > self.cfg.max_timeout:
                raise invalid(f"timeout: {t:g} s exceeds the gateway's max_timeout of {self.cfg.max_timeout:g} s")
        else:
            t = self.cfg.default_timeout
        return t if time_left is None else min(t, time_left)

    async def prepare(self, request, prompt_ids: list[int], time_left: float | None = None) -> Prepared:
        """Validate the rest of a request whose prompt is ``prompt_ids`` (a ``GenerateRequest`` or
        ``ChatRequest``); ``time_left``: the client's own deadline in seconds, if any."""
        if not _ids_given(request):          # token ids: checked by prompt_ids, before it read them
            self.check_prompt_len(len(prompt_ids))
        fwd, params = self._sampling(request.sampling, len(prompt_ids))
        timeout = self._timeout(request, time_left)
        # the stop strings' automaton costs O(their characters): built off the event loop
        make_output = functools.partial(OutputProcessor, self.text.tokenizer, prompt_ids, params)
        output = await asyncio.to_thread(make_output) if params.stop else make_output()
        tenant = CURRENT_TENANT.get()
        return Prepared(request.request_id or uuid.uuid4().hex, request.session_id, prompt_ids, fwd, params,
                        timeout, output, tenant, cache_salt(tenant, request.cache_salt))

    # ---- streaming -------------------------------------------------------------------------
    async def stream(self, p: Prepared) -> AsyncIterator[llm_pb2.GenerateResponse]:
        """Submit ``p`` upstream and yield its messages (gateway.server's docstring: one per
        scheduler message that carries token ids or text, the last with ``finished``).

        Raises:
            Status: ALREADY_EXISTS (the id is in flight here for the same tenant: another tenant's
                request of that id does not count), DEADLINE_EXCEEDED (with ``usage``
                so far; the scheduler aborted the request), the scheduler's own status, or
                UNAVAILABLE when it cannot be reached or ended the stream early.
        Closing the iterator (or cancelling its consumer) cancels the upstream call: the
        scheduler aborts the request and frees its KV blocks at its next step.
        """
        rid, prompt_ids, output, params = p.request_id, p.prompt_ids, p.output, p.params
        key = (p.tenant, rid)
        if self.ended:
            raise Status(_Code.UNAVAILABLE, f"request {rid}: {self.ended} before it was sent to the scheduler; "
                                            "retry it", retry_after=RETRY_AFTER)
        if key in self.live:
            raise Status(_Code.ALREADY_EXISTS, f"request_id: {rid!r} is already in flight")
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"kvmesh.request_id": rid, "gen_ai.request.max_tokens": p.forward.max_tokens,
                                 "gen_ai.request.temperature": params.temperature,
                                 "gen_ai.usage.input_tokens": len(prompt_ids)})
        m = output.metrics
        m.arrival_time = time.monotonic()       # the gateway's timings run from Submit
        call = self.stub.Submit(scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                                            sampling=p.forward, session_id=p.session_id,
                                                            cache_salt=p.cache_salt, tenant=p.tenant),
                                timeout=p.timeout, metadata=telemetry.inject_metadata(span))
        live = self.live[key] = _Live(call)
        try:
            try:
                async for up in call:
                    if up.HasField("usage"):      # cached prompt tokens, speculation counts so far
                        _record_usage(m, up.usage)
                    first = m.first_token_time is None
                    d = output.step(up.token_ids, up.logprobs if params.logprobs is not None else (),
                                    finished=up.finished, finish_reason=finish_reason_name(up) if up.finished else None,
                                    stop_reason=up.stop_reason or None)
                    if first and m.first_token_time is not None:
                        self.metrics.first_token(m.ttft, p.tenant)
                    out = llm_pb2.GenerateResponse(request_id=rid, text=d.text, token_ids=d.token_ids,
                                                   logprobs=d.logprobs)
                    if d.end_upstream:                      # a stop string: end upstream now
                        self._end_upstream(key, live)       # the id is free before the client has the end
                    if d.finished:
                        # the scheduler's timings when it ended the request, else the gateway's clock
                        timings = up.timings if up.finished and up.HasField("timings") else output.timings()
                        _finish(out, finish_reason_to_proto(d.finish_reason), d.stop_reason, output.usage(), timings)
                        self.metrics.usage(out.usage, p.tenant)
                    if out.token_ids or out.text or out.finished:
                        yield out
                    if out.finished:
                        _span_finished(span, out, up.replica)
                        return
            except asyncio.CancelledError:
                # an Abort or the shutdown cancelled the upstream call (not the consumer being cancelled)
                if asyncio.current_task().cancelling() or not (live.aborted or live.ended):
                    raise
                if live.ended and not live.aborted:
                    raise Status(_Code.UNAVAILABLE, f"request {rid}: {live.ended} after {output.num_output_tokens} "
                                                    "tokens; retry it", usage=output.usage(),
                                 retry_after=RETRY_AFTER) from None
                d = output.step((), finished=True, finish_reason="abort")
                out = llm_pb2.GenerateResponse(request_id=rid, text=d.text)
                _finish(out, finish_reason_to_proto(d.finish_reason), d.stop_reason, output.usage(),
                        output.timings())
                _span_finished(span, out, None)
                self.metrics.usage(out.usage, p.tenant)
                yield out
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == _Code.DEADLINE_EXCEEDED:
                    raise Status(_Code.DEADLINE_EXCEEDED, f"request {rid}: deadline of {p.timeout:.3g} s exceeded "
                                                          "(the request was aborted)", usage=output.usage()) from None
                raise self.upstream_status(e) from None
            raise Status(_Code.UNAVAILABLE, f"the scheduler at {self.cfg.scheduler_address} ended request "
                                            f"{rid} without a final message")
        finally:
            self._end_upstream(key, live)

    async def abort(self, rid: str) -> bool:
        """Abort request ``rid`` of the caller's tenant (:data:`gateway.auth.CURRENT_TENANT`): one
        of this gateway has its upstream call cancelled (its stream ends with FINISH_REASON_ABORT);
        another id goes to the scheduler's Abort, with the tenant. Returns whether it was found
        (False when the tenant has no request of that id: another tenant's request of the same id
        is never touched, and is answered as an unknown id is, by the scheduler). Raises Status
        for a failed scheduler call."""
        tenant = CURRENT_TENANT.get()
        live = self.live.get((tenant, rid))
        if live is not None:
            live.aborted = True
            live.call.cancel()
            return True
        try:
            r = await self.stub.Abort(scheduler_pb2.SchedulerAbortRequest(request_id=rid, tenant=tenant),
                                      timeout=ABORT_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            raise self.upstream_status(e) from None
        return r.found

    def _end_upstream(self, key: tuple[str, str], live: _Live) -> None:
        """Cancel the upstream call (a no-op when it finished; else the scheduler aborts the
        request) and free the (tenant, id) ``key``. Idempotent."""
        live.call.cancel()
        if self.live.get(key) is live:
            del self.live[key]

    def upstream_status(self, e: grpc.aio.AioRpcError) -> Status:
        """The status to answer for a failed scheduler call: the scheduler's own status as is (with
        its retry hint, if any: a replica died under the request or none was up),
        UNAVAILABLE 'scheduler at ADDR unreachable: ...' for a connection failure, UNAVAILABLE for
        a call the scheduler cancelled (it was shutting down: retry elsewhere)."""
        details = e.details() or e.code().name
        if e.code() == _Code.UNAVAILABLE and (
                any(s in details.lower() for s in _CONNECTION_ERRORS)
                or self.channel.get_state() != grpc.ChannelConnectivity.READY):
            return Status(_Code.UNAVAILABLE, f"scheduler at {self.cfg.scheduler_address} unreachable: {details}")
        if e.code() == _Code.CANCELLED:    # the scheduler dropped the call (we cancel ours differently)
            return Status(_Code.UNAVAILABLE, f"scheduler at {self.cfg.scheduler_address} cancelled the "
                                             f"request: {details}")
        return Status(e.code(), details, retry_after=retry_hint(e))

    def cancel_all(self) -> None:
        """Cancel every upstream call (server shutdown)."""
        for live in list(self.live.values()):
            live.call.cancel()


def _finish(out: llm_pb2.GenerateResponse, reason: int, stop_reason: int | str | None,
            usage: common_pb2.Usage, timings: common_pb2.Timings) -> None:
    out.finished, out.finish_reason = True, reason
    out.stop_reason = "" if stop_reason is None else str(stop_reason)
    out.usage.CopyFrom(usage)
    out.timings.CopyFrom(timings)


def _span_finished(span, out: llm_pb2.GenerateResponse, replica: int | None) -> None:
    """The request span's attributes from the final message."""
    if not span.is_recording():
        return
    reason = finish_reason_name(out)
    span.set_attributes({"gen_ai.response.finish_reasons": [reason], "kvmesh.finish_reason": reason,
                         "gen_ai.usage.input_tokens": out.usage.prompt_tokens,
                         "gen_ai.usage.output_tokens": out.usage.completion_tokens,
                         "kvmesh.prefix_cache.hit_tokens": out.usage.cached_prompt_tokens,
                         "kvmesh.ttft_s": out.timings.ttft, "kvmesh.e2e_latency_s": out.timings.e2e_latency})
    if out.stop_reason:
        span.set_attribute("kvmesh.stop_reason", out.stop_reason)
    if replica is not None:
        span.set_attribute("kvmesh.replica", replica)


def _record_usage(m: RequestMetrics, usage: common_pb2.Usage) -> None:
    """Copy into ``m`` the cached prompt tokens and speculative counts (cumulative) of a scheduler
    message's ``usage``; a field the message leaves 0 keeps what an earlier one said."""
    m.num_cached_tokens = usage.cached_prompt_tokens or m.num_cached_tokens
    m.num_drafts = usage.spec_num_drafts or m.num_drafts
    m.num_draft_tokens = usage.spec_num_draft_tokens or m.num_draft_tokens
    m.num_accepted_tokens = usage.spec_num_accepted_tokens or m.num_accepted_tokens
