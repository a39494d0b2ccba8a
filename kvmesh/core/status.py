"""The one mapping from errors to the statuses a service answers: gRPC status codes, and for the
gateway's OpenAI-compatible HTTP API the HTTP status and OpenAI error ``type``/``code`` of each.

An :class:`~kvmesh.core.errors.EngineError` answers the code of its class (who is at fault,
:mod:`kvmesh.core.errors`); any other exception is a bug: INTERNAL (HTTP 500).
"""

from __future__ import annotations

import grpc

from kvmesh.core.errors import EngineError

_Code = grpc.StatusCode

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code)
_HTTP = {_Code.INVALID_ARGUMENT: (400, "invalid_request_error", None),
         _Code.OUT_OF_RANGE: (400, "invalid_request_error", None),
         _Code.ALREADY_EXISTS: (409, "invalid_request_error", "request_id_in_use"),
         _Code.NOT_FOUND: (404, "invalid_request_error", "not_found"),
         _Code.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
         _Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
         _Code.UNAVAILABLE: (503, "service_unavailable_error", "service_unavailable"),
         _Code.DEADLINE_EXCEEDED: (504, "timeout_error", "timeout"),
         _Code.CANCELLED: (503, "service_unavailable_error", "cancelled")}
INTERNAL_HTTP = (500, "server_error", "internal_error")
RETRY_PUSHBACK = "grpc-retry-pushback-ms"    # gRPC's standard retry hint: trailing metadata, milliseconds


def grpc_code(e: BaseException) -> grpc.StatusCode:
    """The gRPC status code of an error: its class's (:attr:`EngineError.grpc_code`) for an
    :class:`EngineError`, INTERNAL for anything else."""
    if isinstance(e, EngineError):
        return _Code[e.grpc_code]
    return _Code.INTERNAL


def http_status(code: grpc.StatusCode) -> tuple[int, str, str | None]:
    """``(HTTP status, OpenAI error type, OpenAI error code)`` of a gRPC status code (500
    ``server_error`` for one without its own)."""
    return _HTTP.get(code, INTERNAL_HTTP)


async def abort(context: grpc.aio.ServicerContext, e: BaseException, prefix: str = "") -> None:
    """End the RPC of ``context`` with ``e``'s status (:func:`grpc_code`) and message (after
    ``prefix``). Raises, as ``context.abort`` does: nothing after it runs."""
    await context.abort(grpc_code(e), f"{prefix}{e}")


def set_retry_hint(context: grpc.aio.ServicerContext, seconds: float) -> None:
    """Add a retry hint to the RPC's trailing metadata (``grpc-retry-pushback-ms``): the request
    was not served and may be sent again after ``seconds``."""
    context.set_trailing_metadata(tuple(context.trailing_metadata() or ()) +
                                  ((RETRY_PUSHBACK, str(round(seconds * 1000))),))


def retry_hint(e: grpc.aio.AioRpcError) -> float | None:
    """The retry hint (seconds) in a failed call's trailing metadata, None when it has none."""
    for key, value in e.trailing_metadata() or ():
        if key == RETRY_PUSHBACK:
            try:
                return int(value) / 1000
            except ValueError:
                return None
    return None
