"""The gateway's OpenAI-compatible HTTP API (``--http-port``), in the gateway's process and event loop.

Routes (Starlette, served by uvicorn as a task of the gateway's loop):

* ``POST /v1/chat/completions``, ``POST /v1/completions``: streaming (``"stream": true``: server-sent
  events ``data: {chunk}``, ending with ``data: [DONE]``) and non-streaming; the body's
  ``Content-Type`` must be ``application/json`` (any case, parameters allowed, a ``charset`` only
  ``utf-8``), else 415 ``unsupported_media_type`` before the body is read: a browser page cannot
  send a "simple" cross-origin POST (``text/plain``, a form) that is served; fields in
  :mod:`gateway.openai_protocol`. A request goes through :class:`gateway.stream.RequestPath`, the
  gRPC API's own path: the same validation and limits (GatewayConfig), chat template, stop strings,
  ``max_tokens`` default and cap, deadline (``default_timeout``), usage. The ``max_tokens`` used is
  in the response header ``x-kvmesh-max-tokens``, the request id in ``x-request-id``.
* ``GET /v1/models``: the served model. ``GET /health``: 200 ``{"status": "ok"}`` while the gateway
  is SERVING (its gRPC readiness, which follows the scheduler's health: :mod:`gateway.server`),
  else 503.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` with ``param`` naming the field (a bad value, a limit exceeded, ``n`` >
1, a string holding a lone surrogate such as ``"\\ud800"``), or ``param`` null for the body as a
whole (not UTF-8, not JSON, ``NaN``/``Infinity``, nested deeper than
:data:`gateway.openai_protocol.MAX_JSON_DEPTH`: :func:`gateway.openai_protocol.parse_body`), 404
``model_not_found`` for a model this gateway does not serve, 429 when the scheduler is over
capacity, 503 while the scheduler is unreachable (or the gateway starting; or shutting down:
then with ``Retry-After``, :mod:`gateway.server`, "Shutdown"), 504 when the deadline
passed (the request was aborted), 500 ``internal_error`` for a bug in the gateway: ``param``
null, the request id in the message and in ``x-request-id``, never the exception's text (the
traceback goes to the log, under the same request id). A stream that fails after its first chunk
ends with a ``data: {"error": ...}`` event and ``data: [DONE]``. The server keeps serving after any
of them. ``x-request-id`` holds the id as it is when it is printable ASCII with no space at either
end, else percent-encoded.

A request line and headers over ``max_header_bytes`` (GatewayConfig, 32 KiB) are answered 431
``request_header_fields_too_large`` with the same error body, HTTP that does not parse 400,
before any route runs (:func:`_h11_protocol`: uvicorn's h11 protocol, which alone would answer
a short ``text/plain`` 400, or at 64 KB none, and reset a connection whose client is still
sending): then the server half-closes and reads and drops the rest of what the client sends
(up to ``LINGER_BYTES`` for ``LINGER_SECONDS``) before closing, so the client reads the answer.

A client that disconnects (or closes a stream) has its request cancelled at once: the upstream
``Submit`` call is cancelled and the scheduler aborts the request, freeing its KV blocks at its
next step.

With API keys (:class:`gateway.auth.ApiKeys`) every route but ``/health`` wants the header
``Authorization: Bearer <key>``: without a current key, 401 with OpenAI's ``invalid_api_key``
error (the body is not read); with one, the request runs as the key's tenant
(:data:`gateway.auth.CURRENT_TENANT`: metrics, span, prefix-cache salt). With a certificate and
key the port speaks HTTPS only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import socket
import time
import urllib.parse
import uuid

import grpc

from gateway import openai_protocol as oai
from gateway.auth import CURRENT_TENANT, UNAUTHENTICATED_MESSAGE, ApiKeys
from gateway.stream import RequestPath, Status
from kvmesh.core.errors import DependencyUnavailableError, EngineError
from kvmesh.core.status import INTERNAL_HTTP, grpc_code, http_status

log = logging.getLogger("kvmesh.gateway.http")

_Code = grpc.StatusCode
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def status_error(e: Status, chat: bool = False) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) of a Status; an unknown model is 404 ``model_not_found``.
    ``param`` names a field of the request body: ``prompt`` for the gRPC API's
    ``prompt_token_ids``, ``messages`` for a chat request's prompt, None for the body as a whole
    (``request``)."""
    param = e.param
    if param == "model" and "unknown model" in e.message:
        return 404, error_body(e.message, "invalid_request_error", "model", "model_not_found")
    http, type_, code = http_status(e.code)
    param = {"prompt_token_ids": "prompt", "request": None}.get(param, param)
    if chat and param == "prompt":
        param = "messages"
    return http, error_body(e.message, type_, param, code)


def _json_bytes(obj) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:      # a lone surrogate: escaped as JSON may (\ud800), never sent raw
        return json.dumps(obj, separators=(",", ":")).encode()


_HEADER_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


def header_value(s: str) -> bytes:
    """``s`` as an HTTP header value: as it is when it is printable ASCII without a space at
    either end, else percent-encoded UTF-8 (``x-request-id`` of an id with other characters)."""
    return (s if _HEADER_VALUE.fullmatch(s) else urllib.parse.quote(s, safe="")).encode()


async def _send_json(send, status: int, obj, headers: list | None = None) -> None:
    body = _json_bytes(obj)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive, limit: int) -> bytes | None:
    """The request body (None: the client went away first); Status INVALID_ARGUMENT once it
    exceeds ``limit`` bytes."""
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Status(_Code.INVALID_ARGUMENT, f"request: body exceeds max_message_bytes ({limit})")
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _authorization(scope) -> str | None:
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"authorization"), None)


def tenant_of(keys: ApiKeys | None, scope) -> str | None:
    """The caller's tenant by the ``Authorization`` header of an ASGI ``scope``: "" without keys,
    None for a missing or wrong key."""
    return "" if keys is None else keys.tenant_for(_authorization(scope))


_UNAUTHORIZED = (401, error_body(UNAUTHENTICATED_MESSAGE, "invalid_request_error", None, "invalid_api_key"),
                 [(b"www-authenticate", b"Bearer")])
_PARSE_OFF_LOOP = 64 * 1024     # bodies over this many bytes are parsed in a thread (0.3 s at 4 MB)


def content_type_error(scope) -> tuple[int, dict] | None:
    """415 with OpenAI's error body unless the request's ``Content-Type`` is ``application/json``
    (any case; parameters allowed, a ``charset`` only UTF-8's); None when it is."""
    value = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"content-type"), None)
    if value is not None:
        media, *params = value.split(";")
        charsets = [v.strip().strip('"').lower() for k, _, v in (p.partition("=") for p in params)
                    if k.strip().lower() == "charset"]
        if media.strip().lower() == "application/json" and all(c in ("utf-8", "utf8") for c in charsets):
            return None
    got = "none" if value is None else repr(value[:100])
    return 415, error_body(f"Content-Type must be application/json (a charset, if any, utf-8); got {got}",
                           "invalid_request_error", None, "unsupported_media_type")


class CompletionsEndpoint:
    """The ASGI app of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``; ``keys``: the
    API keys a caller needs (None: none)."""

    def __init__(self, path: RequestPath, chat: bool, keys: ApiKeys | None = None):
        self.path, self.chat, self.keys = path, chat, keys
        self.method = "ChatCompletions" if chat else "Completions"   # kvmesh:gateway_requests_total{method}

    async def __call__(self, scope, receive, send) -> None:
        # response started / complete; the final status for the metrics; the request id (the
        # request's own once known; one of ours until then, for a 500 before it)
        state = {"started": False, "complete": False, "code": "OK", "rid": uuid.uuid4().hex}
        tenant = tenant_of(self.keys, scope)
        if tenant is None:                  # refused before the body is read
            self.path.metrics.request_done(self.method, "UNAUTHENTICATED")
            await _send_json(send, *_UNAUTHORIZED)
            return
        if (refused := content_type_error(scope)) is not None:      # the body is not read either
            self.path.metrics.request_done(self.method, "INVALID_ARGUMENT", tenant)
            await _send_json(send, *refused)
            return
        CURRENT_TENANT.set(tenant)          # this task and the ones it starts
        try:
            body = await _read_body(receive, self.path.cfg.max_message_bytes)
            if body is None:
                state["code"] = "CANCELLED"
                return
            work = asyncio.ensure_future(self._run(scope, body, send, state))
            gone = asyncio.ensure_future(_until_disconnect(receive))
            try:
                await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not work.done() and not state["complete"]:   # the client went away: cancel upstream
                    work.cancel()
                    state["code"] = "CANCELLED"
                gone.cancel()
                await asyncio.gather(work, gone, return_exceptions=True)
            if not work.cancelled() and work.exception() is not None:
                raise work.exception()
        except Status as e:
            state["code"] = e.code.name
            retry = [] if e.retry_after is None else [(b"retry-after", str(math.ceil(e.retry_after)).encode())]
            await self._error(send, state, *status_error(e, self.chat), retry)
        except EngineError as e:            # its class says whose fault (kvmesh.core.status)
            state["code"] = grpc_code(e).name
            await self._error(send, state, *status_error(Status(grpc_code(e), str(e)), self.chat))
        except asyncio.CancelledError:
            state["code"] = "CANCELLED"
            raise
        except OSError:                     # the client went away while we wrote (ClientDisconnected)
            state["code"] = "CANCELLED"
        except Exception:                   # a bug: the traceback to the log, not to the client
            state["code"] = "INTERNAL"
            rid = state["rid"]
            log.exception("%s failed (request id %s)", self.method, rid)
            message = f"internal error in the gateway (request id {rid}; the gateway's log has the details)"
            with contextlib.suppress(Exception):
                await self._error(send, state, INTERNAL_HTTP[0], error_body(message, INTERNAL_HTTP[1], None,
                                                                            INTERNAL_HTTP[2]),
                                  [(b"x-request-id", header_value(rid))])
        finally:
            self.path.metrics.request_done(self.method, state["code"], tenant)

    async def _error(self, send, state: dict, status: int, body: dict, headers: list | None = None) -> None:
        if not state["started"]:
            await _send_json(send, status, body, headers)
        else:                               # mid-stream: an error event, then the end
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"data: " + _json_bytes(body) + b"\n\n"
                            + b"data: [DONE]\n\n"})

    async def _run(self, scope, body: bytes, send, state: dict) -> None:
        self.path.check_ready()
        with self.path.admitted():          # refused while the gateway drains (a retry hint)
            await self._serve(scope, body, send, state)

    async def _serve(self, scope, body: bytes, send, state: dict) -> None:
        path = self.path
        parsed = (await asyncio.to_thread(oai.parse_body, body) if len(body) > _PARSE_OFF_LOOP
                  else oai.parse_body(body))
        request, opts = (oai.chat_request if self.chat else oai.completion_request)(parsed)
        opts.model = opts.model or path.info.name
        carrier = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ())]
        name, operation = ("chat", "chat") if self.chat else ("generate", "text_completion")
        with path.span(name, operation, request, carrier):
            path.check_model(request.model)
            path.check_limits(request)
            if request.request_id:
                state["rid"] = request.request_id
            else:
                request.request_id = state["rid"]
            try:
                prompt_ids = await path.prompt_ids(request)
            except EngineError as e:        # an empty prompt, no chat template
                raise Status(grpc_code(e), f"{'messages' if self.chat else 'prompt'}: {e}") from None
            prepared = await path.prepare(request, prompt_ids)
            responder = oai.Responder(opts, prepared.request_id, path.text.tokenizer)
            headers = [(b"x-request-id", header_value(prepared.request_id)),
                       (b"x-kvmesh-max-tokens", str(prepared.forward.max_tokens).encode())]
            async with contextlib.aclosing(path.stream(prepared)) as messages:
                if opts.stream:
                    await self._stream(messages, responder, send, headers, state)
                else:
                    outs = [out async for out in messages]
                    state["started"] = True
                    await _send_json(send, 200, responder.body(outs), headers)
                    state["complete"] = True

    async def _stream(self, messages, responder: oai.Responder, send, headers: list, state: dict) -> None:
        """Server-sent events: the response starts with the first message (an error before it is
        a plain HTTP error), one ``data:`` event per chunk, the usage chunk, ``data: [DONE]``."""
        async for out in messages:
            if not state["started"]:
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + headers})
                state["started"] = True
            events = []
            if (chunk := responder.chunk(out)) is not None:
                events.append(chunk)
            if out.finished and responder.opts.include_usage:
                events.append(responder.usage_chunk(out))
            data = b"".join(b"data: " + _json_bytes(c) + b"\n\n" for c in events)
            if out.finished:
                await send({"type": "http.response.body", "body": data + b"data: [DONE]\n\n"})
                state["complete"] = True
                return
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})


def build_app(path: RequestPath, keys: ApiKeys | None = None):
    """The Starlette app of the routes in the module docstring, over ``path``; ``keys``: the API
    keys callers need (None: none)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    started = int(time.time())

    async def models(request):
        if tenant_of(keys, request.scope) is None:
            return JSONResponse(_UNAUTHORIZED[1], 401, headers={"www-authenticate": "Bearer"})
        if path.info is None:
            return JSONResponse(error_body("the gateway is starting", *http_status(_Code.UNAVAILABLE)[1:]), 503)
        return JSONResponse({"object": "list", "data": [{
            "id": path.info.name, "object": "model", "created": started, "owned_by": "kvmesh",
            "max_model_len": path.info.max_model_len}]})

    async def health(request):
        if path.serving:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, 503)

    async def http_error(request, exc: HTTPException):
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error",
                                       None, "not_found" if exc.status_code == 404 else None), exc.status_code)

    return Starlette(routes=[Route("/v1/chat/completions", CompletionsEndpoint(path, True, keys), methods=["POST"]),
                             Route("/v1/completions", CompletionsEndpoint(path, False, keys), methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/health", health, methods=["GET"])],
                     exception_handlers={HTTPException: http_error})


class HttpServer:
    """A running HTTP API: ``port`` is the bound port, ``url`` the base URL of its ``/v1`` routes
    (``https://`` with TLS)."""

    def __init__(self, server, task: asyncio.Task, host: str, port: int, tls: bool = False):
        from kvmesh.core.net import connect_address
        self.server, self.task, self.host, self.port = server, task, host, port
        self.address = connect_address(host, port)
        self.url = f"{'https' if tls else 'http'}://{self.address}/v1"

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting, give open requests ``grace`` seconds (None = wait for them), then close
        their connections (their requests are cancelled upstream). Idempotent."""
        self.server.config.timeout_graceful_shutdown = grace
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


LINGER_SECONDS = 5.0            # after a malformed request's answer, how long its bytes are read on
LINGER_BYTES = 16 * 2**20       # ... and how many, before the connection is closed


def _h11_protocol(max_header_bytes: int):
    """uvicorn's h11 protocol answering a request it cannot take with OpenAI's error body: 431
    for a request line and headers over ``max_header_bytes`` (whether h11 is still waiting for
    the end of the headers or has them all), 400 for malformed HTTP; then it stops writing
    (half-close) and reads and drops what the client still sends (up to LINGER_BYTES, for up to
    LINGER_SECONDS) before closing, so that the client reads the answer instead of a reset
    connection."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Connection(h11.Connection):
        error: h11.RemoteProtocolError | None = None

        def next_event(self):
            try:
                event = super().next_event()
            except h11.RemoteProtocolError as e:
                self.error = e
                raise
            if isinstance(event, h11.Request):
                size = len(event.method) + len(event.target) + 12 + sum(
                    len(k) + len(v) + 4 for k, v in event.headers.raw_items())
                if size > max_header_bytes:
                    self.error = h11.RemoteProtocolError("headers too large", error_status_hint=431)
                    raise self.error
            return event

    class Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.conn = Connection(h11.SERVER, max_incomplete_event_size=max_header_bytes)
            self.lingering, self.dropped = False, 0

        def send_400_response(self, msg: str) -> None:      # uvicorn's answer to h11.RemoteProtocolError
            error = self.conn.error
            status = getattr(error, "error_status_hint", 400)
            if status == 431:
                body = error_body(f"request headers: the request line and headers exceed max_header_bytes "
                                  f"({max_header_bytes} bytes)", "invalid_request_error", None,
                                  "request_header_fields_too_large")
            else:
                status = 400
                body = error_body(f"malformed HTTP request: {str(error)[:200] or 'cannot be parsed'}",
                                  "invalid_request_error", None, None)
            data = _json_bytes(body)
            head = (f"HTTP/1.1 {status} {'Request Header Fields Too Large' if status == 431 else 'Bad Request'}\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(data)}\r\nconnection: close\r\n\r\n")
            self.transport.write(head.encode() + data)
            self.lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.transport.resume_reading()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if not self.lingering:
                super().data_received(data)
                return
            self.dropped += len(data)
            if self.dropped > LINGER_BYTES:
                self.transport.close()

    return Protocol


def _uvicorn_server(app, tls_cert_file: str = "", tls_key_file: str = "", max_header_bytes: int = 32 * 1024):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn inside a loop it does not own: the process's signals stay its owner's."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def install_signal_handlers(self) -> None:
            pass

    # log_config None: leave the process's logging as it is; lifespan off: nothing to start
    tls = dict(ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file) if tls_cert_file else {}
    return Server(uvicorn.Config(app, http=_h11_protocol(max_header_bytes), log_config=None, access_log=False,
                                 lifespan="off", server_header=False, **tls))


async def start_http(path: RequestPath, host: str, port: int, *, api_keys: ApiKeys | None = None,
                     tls_cert_file: str = "", tls_key_file: str = "", max_header_bytes: int = 32 * 1024
                     ) -> HttpServer:
    """Serve the HTTP API over ``path`` on ``host:port`` (0 = any free port) as a task of the
    running loop; returns once it accepts connections. ``api_keys``: the keys callers need (None:
    none); ``tls_cert_file``/``tls_key_file``: serve HTTPS only; ``max_header_bytes``: a request
    line and headers over this many bytes are answered 431. Raises EngineError if the address
    cannot be bound or the TLS files do not load."""
    if tls_cert_file:
        from kvmesh.core import tls
        tls.read_pem(tls_cert_file, "tls_cert_file")      # an error naming the setting, not uvicorn's
        tls.read_pem(tls_key_file, "tls_key_file")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise DependencyUnavailableError(f"cannot listen on {host}:{port} for HTTP ({e}): is the port in use? "
                                         "choose another --http-port (0 = any free port)") from None
    server = _uvicorn_server(build_app(path, api_keys), tls_cert_file, tls_key_file, max_header_bytes)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="kvmesh-http")
    while not server.started:
        if task.done():
            sock.close()
            raise DependencyUnavailableError(f"the HTTP API on {host}:{port} failed to start: {task.exception()!r}")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, host, sock.getsockname()[1], tls=bool(tls_cert_file))
